"""``kvserve plan --kv-calibration FILE`` or ``--kv-dtype auto --kv-quality-budget kl=1e-3``: plan
with the per-layer KV map the engine would run (docs/kv-quant.md, "Precision per layer").

A file gives its map (checked against the model's layer count). A budget calibrates the model as
the engine does at start-up (:func:`kvserve.eval.calibrate.resolve_calibration`, the same cache),
so it needs a local checkpoint the engine can run; a preset or a bare config.json has no weights
to measure and is refused with what to give instead.
"""

from __future__ import annotations

from pathlib import Path

from kvserve.kv.calibration import Calibration, parse_quality_budget


def planned_map(model: str, num_layers: int, kv_dtype: str, *, calibration: str | None, budget: str | None,
                block_size: int) -> tuple[str, str]:
    """(the canonical map name, where it came from). Raises ValueError saying what to fix."""
    if budget is not None:
        parse_quality_budget(budget)
        if kv_dtype.strip().lower() != "auto":
            raise ValueError(f"--kv-quality-budget chooses the KV codec per layer; it needs --kv-dtype auto, "
                             f"got {kv_dtype!r}")
    file = Path(calibration).expanduser() if calibration else None
    if file is not None and file.exists():
        cal = Calibration.load(file)
        if len(cal.layers) != num_layers:
            raise ValueError(f"KV calibration file {str(file)!r} has {len(cal.layers)} layers but the model has "
                             f"{num_layers}")
        return cal.kv_dtype, f"calibration {file}"
    root = Path(model)
    if not (root.is_dir() and any(root.glob("*.safetensors"))):
        raise ValueError("--kv-quality-budget calibrates on the model's weights: give --model a checkpoint "
                         "folder, or --kv-calibration FILE from an engine's start-up")
    from kvserve.config import CacheConfig, EngineConfig
    from kvserve.eval.calibrate import resolve_calibration
    from kvserve.model.loader import load_model_config, load_tokenizer

    cfg = EngineConfig(model=str(root), cache=CacheConfig(block_size=block_size, kv_quality_budget=budget,
                                                          kv_calibration=calibration))
    cal = resolve_calibration(cfg, load_model_config(str(root)), load_tokenizer(str(root)))
    return cal.kv_dtype, f"calibrated (kl={cal.budget_kl:g}, joint {cal.joint_kl:.2e}; {cal.source})"
