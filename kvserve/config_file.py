"""Engine config files: JSON whose keys are the fields of :mod:`kvserve.config`'s dataclasses.

    {
      "model": "/models/llama-3.1-8b",
      "dtype": "bfloat16",
      "cache": {"block_size": 16, "kv_cache_memory": 42949672960, "kv_cache_dtype": "int8",
                "enable_prefix_caching": true},
      "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 4096, "max_model_len": 32768},
      "extras": {"session_idle_timeout_s": 600, "sliding_window": null, "reserve_bytes": ..., ...}
    }

``kvserve plan --write-config FILE`` writes one; :func:`load_engine_config` reads it back into an
:class:`~kvserve.config.EngineConfig` (the engine and ``kvserve serve --config`` take that).
``extras`` holds the planner's recommendations that are not engine fields (yet). Every key is
checked: an unknown key or a value of the wrong type is a one-line ``ValueError`` naming it.
``kv_cache_memory`` may also be written as a size string (``"40GiB"``).
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig, parse_size, read_json


@dataclass(frozen=True)
class DeploymentExtras:
    """Planner recommendations the engine config does not carry."""

    session_idle_timeout_s: int | None = None
    sliding_window: int | None = None
    reserve_bytes: int = 0
    utilization: float | None = None
    tensor_parallel: int = 1
    hardware: str | None = None
    scenario: str | None = None

    def __post_init__(self) -> None:
        if self.session_idle_timeout_s is not None and self.session_idle_timeout_s <= 0:
            raise ValueError(f"session_idle_timeout_s must be > 0 or null, got {self.session_idle_timeout_s}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 or null, got {self.sliding_window}")
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {self.reserve_bytes}")
        if self.utilization is not None and not 0.0 < self.utilization <= 1.0:
            raise ValueError(f"utilization must be in (0, 1], got {self.utilization}")
        if self.tensor_parallel <= 0:
            raise ValueError(f"tensor_parallel must be > 0, got {self.tensor_parallel}")


@dataclass(frozen=True)
class ConfigFile:
    engine: EngineConfig
    extras: DeploymentExtras


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether a JSON value matches a simple field type (int, float, str, bool, X | None)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # a type this reader does not know: let the dataclass validate it


def _build(cls: type, data: Any, where: str, nested: dict[str, type] | None = None) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")  # noqa: TRY004
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"{where}: unknown key {key!r}; valid: {', '.join(known)}")
        if nested and key in nested:
            kwargs[key] = _build(nested[key], value, f"{where}.{key}")
            continue
        if isinstance(hints[key], type) and is_dataclass(hints[key]):  # e.g. scheduler.speculative
            kwargs[key] = _build(hints[key], value, f"{where}.{key}")
            continue
        if key == "kv_cache_memory" and isinstance(value, str):
            value = parse_size(value)
        if not _type_ok(value, hints[key]):
            raise ValueError(f"{where}.{key}: expected {hints[key]}, got {value!r}")
        kwargs[key] = value
    missing = [
        n
        for n, f in known.items()
        if n not in kwargs and f.default is MISSING and f.default_factory is MISSING
    ]
    if missing:
        raise ValueError(f"{where}: missing required key {missing[0]!r}")
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def read_config_file(path: str | Path) -> ConfigFile:
    """Read and validate a config file; errors name the file and the key."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} not found")
    data = read_json(p)
    if not isinstance(data, dict):
        raise ValueError(f"{p} must hold a JSON object")  # noqa: TRY004 - a user error, one line
    extras = _build(DeploymentExtras, data.get("extras", {}), f"{p}: extras")
    body = {k: v for k, v in data.items() if k != "extras"}
    engine = _build(EngineConfig, body, str(p), {"cache": CacheConfig, "scheduler": SchedulerConfig})
    return ConfigFile(engine, extras)


def load_engine_config(path: str | Path) -> EngineConfig:
    """The :class:`EngineConfig` a config file describes (``extras`` are checked, then set aside)."""
    return read_config_file(path).engine


def config_to_dict(engine: EngineConfig, extras: DeploymentExtras) -> dict[str, Any]:
    return {**asdict(engine), "extras": asdict(extras)}


def write_config_file(path: str | Path, engine: EngineConfig, extras: DeploymentExtras) -> Path:
    """Write ``engine`` and ``extras`` as JSON (creating parent folders); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(config_to_dict(engine, extras), indent=2) + "\n")
    return p
