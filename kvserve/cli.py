"""The ``kvserve`` command line.

Each feature registers its own sub-commands from its own module (``register(app)``), so this file
stays a table of contents. Errors a user can fix print one line and exit with code 2.
"""

from __future__ import annotations

import sys

import typer

app = typer.Typer(
    name="kvserve",
    help="kvserve: a KV-cache-centred LLM inference server.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_all() -> None:
    from kvserve import assets
    from kvserve.bench import cli as bench_cli
    from kvserve.engine import cli_generate
    from kvserve.model import cli_make_model
    from kvserve.planner import cli as planner_cli
    from kvserve.server import cli as server_cli

    assets.register(app)
    bench_cli.register(app)
    cli_generate.register(app)
    cli_make_model.register(app)
    planner_cli.register(app)
    server_cli.register(app)
    __import__("kvserve.eval.cli", fromlist=["register"]).register(app)  # kvserve eval kv


_register_all()


def main() -> None:
    """Entry point: user-fixable errors become one line on stderr and exit code 2."""
    try:
        app()
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
