"""Shipped models: found inside the package, listed by ``kvserve models``, packaged by setuptools."""

from __future__ import annotations

import json
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import typer
from typer.testing import CliRunner

from kvserve import assets

MAX_BYTES = 30 * 1024 * 1024
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json")


def test_default_model_is_shipped_with_all_files() -> None:
    path = assets.default_model_path()
    assert assets.shipped_models()[assets.DEFAULT_MODEL] == path
    for name in REQUIRED:
        assert (path / name).is_file(), name
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())


def test_shipped_assets_fit_the_size_limit() -> None:
    total = sum(f.stat().st_size for f in assets.MODELS_DIR.rglob("*") if f.is_file())
    assert 0 < total <= MAX_BYTES


def test_missing_default_model_names_the_rebuild_command(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(assets, "MODELS_DIR", tmp_path)
    assert assets.shipped_models() == {}
    try:
        assets.default_model_path()
    except FileNotFoundError as exc:
        assert "train_tiny.py" in str(exc)
    else:
        raise AssertionError("expected FileNotFoundError")


def test_models_command_lists_paths() -> None:
    app = typer.Typer()
    assets.register(app)

    @app.command("noop")
    def noop() -> None:  # a second command keeps typer from flattening the app
        """Unused."""

    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    assert assets.DEFAULT_MODEL in result.output
    assert str(assets.default_model_path()) in result.output


def test_package_data_globs_cover_the_model_files() -> None:
    """setuptools ships ``kvserve/<glob>`` for each package-data glob; every asset must match one.

    (``fnmatch``'s ``*`` crosses ``/``, like setuptools' recursive ``**``; checked for real with
    ``pip install --no-deps --target``, see docs/model.md.)
    """
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["kvserve"]
    package_root = Path(assets.__file__).parent.parent
    files = [f for f in assets.MODELS_DIR.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    assert files
    for f in files:
        rel = f.relative_to(package_root).as_posix()
        assert any(fnmatch(rel, g) for g in globs), rel
