"""The house rules the contract rests on, checked: KV bookkeeping imports no torch, the scheduler
imports nothing from the runner or the model, and no file in kvserve/ is over 400 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "kvserve"
BOOKKEEPING = ["kvserve.kv.block_pool", "kvserve.kv.manager", "kvserve.kv.hashing", "kvserve.kv.sessions",
               "kvserve.kv.events", "kvserve.kv.eviction", "kvserve.kv.shadow_window", "kvserve.contract",
               "kvserve.scheduler.scheduler", "kvserve.spec.drafter", "kvserve.kv.calibration", "kvserve.kv.layout",
               "kvserve.kv.codec_names"]


@pytest.mark.parametrize("module", BOOKKEEPING)
def test_bookkeeping_imports_no_torch(module: str) -> None:
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]"
    subprocess.run([sys.executable, "-c", code], check=True)


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_scheduler_imports_nothing_from_the_runner_or_the_model() -> None:
    for path in (ROOT / "scheduler").glob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith(("kvserve.runner", "kvserve.model", "torch"))}
        assert not bad, f"{path.name} imports {bad}"


def test_no_file_in_kvserve_is_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
