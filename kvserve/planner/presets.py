"""Model and hardware presets shipped with the package (``kvserve/planner/data/*.json``).

The files are copies of the project's checked reference data; each entry keeps its ``source``,
``verified`` and ``notes`` fields so a printed figure can be traced back. Lookup is by exact key
(case-insensitive) or a short alias; an unknown name raises ``ValueError`` that suggests the
nearest names.
"""

from __future__ import annotations

import difflib
import json
from functools import cache
from importlib import resources
from typing import Any

# Short names people type; each maps to one preset key.
HARDWARE_ALIASES: dict[str, str] = {
    "h100": "h100-sxm-80gb",
    "h100-sxm": "h100-sxm-80gb",
    "h100-pcie": "h100-pcie-80gb",
    "h200": "h200-141gb",
    "a100": "a100-sxm-80gb",
    "a100-80gb": "a100-sxm-80gb",
    "a100-80": "a100-sxm-80gb",
    "a100-40": "a100-40gb",
    "l40s": "l40s-48gb",
    "l4": "l4-24gb",
    "a10": "a10-24gb",
    "rtx-4090": "rtx-4090-24gb",
    "4090": "rtx-4090-24gb",
    "rtx-3090": "rtx-3090-24gb",
    "3090": "rtx-3090-24gb",
    "mi300x": "mi300x-192gb",
    "m2-ultra": "m2-ultra-192gb",
}
MODEL_ALIASES: dict[str, str] = {
    "llama-3-8b-instruct": "llama-3-8b",
    "llama3-8b": "llama-3-8b",
    "llama-3.1-8b-instruct": "llama-3.1-8b",
    "mixtral": "mixtral-8x7b",
    "deepseek": "deepseek-v3",
    "tinyllama": "tinyllama-1.1b",
    "mistral-7b": "mistral-7b-v0.1",
    "gemma-2": "gemma-2-9b",
}


@cache
def _load(name: str) -> dict[str, dict[str, Any]]:
    text = resources.files("kvserve.planner").joinpath("data", name).read_text(encoding="utf-8")
    data: dict[str, dict[str, Any]] = json.loads(text)
    return data


def model_presets() -> dict[str, dict[str, Any]]:
    """Every model preset, keyed by name (``llama-3.1-8b``, ``deepseek-v3`` …)."""
    return _load("models.json")


def hardware_presets() -> dict[str, dict[str, Any]]:
    """Every accelerator preset, keyed by name (``h100-sxm-80gb`` …)."""
    return _load("hardware.json")


def _lookup(
    kind: str, name: str, table: dict[str, dict[str, Any]], aliases: dict[str, str], hint: str
) -> tuple[str, dict[str, Any]]:
    key = name.strip().lower()
    key = aliases.get(key, key)
    if key in table:
        return key, table[key]
    choices = sorted(set(table) | set(aliases))
    near = difflib.get_close_matches(key, choices, n=3, cutoff=0.5)
    near_keys = list(dict.fromkeys(aliases.get(n, n) for n in near))
    suggestion = f"did you mean {', '.join(near_keys)}? " if near_keys else ""
    raise ValueError(f"unknown {kind} preset {name!r}; {suggestion}{hint}")


def find_model(name: str) -> tuple[str, dict[str, Any]]:
    """(key, entry) of a model preset, or ``ValueError`` naming the nearest presets."""
    return _lookup(
        "model",
        name,
        model_presets(),
        MODEL_ALIASES,
        "or pass a config.json path or a checkpoint folder (list: kvserve plan --list)",
    )


def find_hardware(name: str) -> tuple[str, dict[str, Any]]:
    """(key, entry) of an accelerator preset, or ``ValueError`` naming the nearest presets."""
    return _lookup(
        "hardware",
        name,
        hardware_presets(),
        HARDWARE_ALIASES,
        "or pass cpu, or --memory/--bandwidth by hand (list: kvserve plan --list)",
    )
