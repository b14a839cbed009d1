"""``python -m kvserve.planner plan …``: the planner alone, with :func:`kvserve.cli.main`'s error
handling (one line on stderr, exit 2), for when the rest of the CLI is not importable."""

from __future__ import annotations

import sys

import typer

from kvserve.planner.cli import register


def main(argv: list[str] | None = None) -> None:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True)

    @app.callback()
    def _root() -> None:
        """kvserve planner."""

    register(app)
    try:
        app(args=argv)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
