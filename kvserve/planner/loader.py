"""``--model``: a ``config.json`` path, a checkpoint folder, or a preset name."""

from __future__ import annotations

from pathlib import Path

from kvserve.config import read_json
from kvserve.planner.model_spec import ModelSpec, spec_from_hf_dict
from kvserve.planner.presets import find_model


def _looks_like_path(arg: str) -> bool:
    return "/" in arg or "\\" in arg or arg.endswith(".json") or arg.startswith(".")


def load_model(arg: str) -> ModelSpec:
    """Read ``arg`` as a path when one exists there (or it looks like one), else as a preset.

    A checkpoint folder is read through its ``config.json``; weights are not opened (the planner
    counts parameters from the shape). Errors are one line: a missing path, bad JSON, a missing or
    non-positive field, or an unknown preset with the nearest names.
    """
    path = Path(arg).expanduser()
    if path.exists():
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}; pass a Hugging Face checkpoint folder")
        data = read_json(cfg_file)
        kind = "checkpoint" if path.is_dir() else "config"
        name = path.name if path.is_dir() else path.parent.name or cfg_file.name
        return spec_from_hf_dict(data, name, f"{kind} {cfg_file}")
    if _looks_like_path(arg):
        raise FileNotFoundError(f"--model {arg}: no such file or folder")
    key, entry = find_model(arg)
    return spec_from_hf_dict(entry, key, f"preset {key}")
