"""Models shipped inside the package, so kvserve runs with no download.

A shipped model is a Hugging Face directory under ``kvserve/assets/models/<name>/`` holding at
least ``config.json``; ``default_model_path()`` is the one every command uses when ``--model`` is
not given.
"""

from __future__ import annotations

from pathlib import Path

import typer

MODELS_DIR = Path(__file__).resolve().parent / "models"
DEFAULT_MODEL = "kvserve-tiny-chat"


def shipped_models() -> dict[str, Path]:
    """Name → directory of every shipped model (a directory with a ``config.json``), sorted by name."""
    if not MODELS_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(MODELS_DIR.iterdir()) if (p / "config.json").is_file()}


def default_model_path() -> Path:
    """The directory of the default shipped model; raises ``FileNotFoundError`` if it is missing."""
    path = MODELS_DIR / DEFAULT_MODEL
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL!r} is not installed at {path}; "
            "rebuild it with: python scripts/train_tiny.py --minutes 48"
        )
    return path


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def register(app: typer.Typer) -> None:
    """Add ``kvserve models``."""

    @app.command("models")
    def models() -> None:
        """List the models shipped inside the package, with their paths."""
        found = shipped_models()
        if not found:
            typer.echo("no shipped models found")
            raise typer.Exit(1)
        for name, path in found.items():
            mark = " (default)" if name == DEFAULT_MODEL else ""
            typer.echo(f"{name}{mark}\t{_size_mb(path):.1f} MB\t{path}")
