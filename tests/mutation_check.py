"""Plant known bugs one at a time in a copy of the code and check that the suite catches each.

    .venv/bin/python tests/mutation_check.py            # every mutation, with a baseline run first
    .venv/bin/python tests/mutation_check.py --list     # the mutations and the tests that must catch them
    .venv/bin/python tests/mutation_check.py 3 5        # only mutations 3 and 5

Not a test module (pytest collects ``test_*.py`` only). For each mutation it copies ``kvserve/``,
``tests/`` and ``pyproject.toml`` into a temporary directory, applies the bug by exact text
replacement inside one named function, runs the test files that must catch it (``-x -q -p
no:cacheprovider``, a per-test timeout) and requires a non-zero exit. An anchor that is no longer
found fails loudly, naming the file, the function and the text: the code moved, so update the
anchor here. Before the mutations, the same test targets run once on the unmodified copy and must
pass, so that a mutation counts as caught only when the tests are otherwise green.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PER_TEST_TIMEOUT_S = 120   # pytest-timeout inside each run: a hang is a failure with a traceback
RUN_TIMEOUT_S = 900        # the whole pytest run of one target


@dataclass(frozen=True)
class Edit:
    """In ``path``, inside ``def function(``, replace the first ``old`` by ``new`` (``new`` may use
    ``{indent}``: the indentation of the function's body). ``old=None`` inserts ``new`` as the
    body's first line (after the docstring, if any)."""

    path: str
    function: str
    old: str | None
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    edits: tuple[Edit, ...]
    targets: tuple[tuple[str, ...], ...]  # each: pytest arguments that must fail under the mutation


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("BlockPool.reset_cache is a no-op",
             (Edit("kvserve/kv/block_pool.py", "reset_cache", "self._evict_hash(b)", "pass"),),
             (("tests/kv/test_block_pool.py", "tests/kv/test_manager.py"),)),
    Mutation("KVCacheManager.cache_blocks caches one block fewer",
             (Edit("kvserve/kv/manager.py", "cache_blocks", "req.num_computed_tokens // self.block_size",
                   "(req.num_computed_tokens - 1) // self.block_size"),),
             (("tests/kv/test_manager.py",), ("tests/engine/test_engine_parity.py",))),
    Mutation("Scheduler._finish frees only running requests",
             (Edit("kvserve/scheduler/scheduler.py", "_finish", None, "{indent}_was_running = req in self.running"),
              Edit("kvserve/scheduler/scheduler.py", "_finish", "self.kv.free(req)",
                   "(self.kv.free(req) if _was_running else None)")),
             (("tests/scheduler/test_scheduler.py",), ("tests/engine/test_engine_sampling.py",))),
    Mutation("preemption keeps num_computed_tokens",
             (Edit("kvserve/scheduler/scheduler.py", "_preempt", "req.num_computed_tokens = 0", "pass"),),
             (("tests/scheduler/test_scheduler.py",), ("tests/engine/test_engine_parity.py",))),
    Mutation("LLMEngine.abort_request aborts only the first of n samples",
             (Edit("kvserve/engine/engine.py", "abort_request", "self.outputs.children(request_id)",
                   "self.outputs.children(request_id)[:1]"),),
             (("tests/engine/test_engine_sampling.py",),
              ("tests/server/test_errors.py", "-k", "disconnect"))),
    Mutation("a window drops one block it still reads",
             (Edit("kvserve/kv/press/window.py", "droppable", "num_computed + 1 - window) // block_size",
                   "num_computed + 1 - window) // block_size + 1"),),
             (("tests/kv/test_press_policies.py",), ("tests/scheduler/test_scheduler_forgetting.py",))),
    Mutation("lossy KV is cached as if canonical",
             (Edit("kvserve/kv/forgetting.py", "canonical_tokens", "return min(bounds) if bounds else None",
                   "return None"),),
             (("tests/kv/test_miss_reasons.py",), ("tests/engine/test_sinks_window.py", "-k", "batch_of_eight"))),
    Mutation("sinks ignored when the window starts inside a chunk",
             (Edit("kvserve/model/attention_kept.py", "needs_kept_path", "window is not None and seq_len > window",
                   "window is not None and seq_len - q_len - window + 1 > 0"),),
             (("tests/model/test_attention_kept.py",),)),
)


class AnchorError(RuntimeError):
    pass


def function_span(text: str, function: str, path: str) -> tuple[int, int, str]:
    """(start of the body, end of the function, the body's indentation) of ``def function(``."""
    m = re.search(rf"^(?P<ind>[ \t]*)def {re.escape(function)}\(", text, re.MULTILINE)
    if m is None:
        raise AnchorError(f"{path}: no 'def {function}(' found")
    indent = m.group("ind")
    colon = re.compile(r"\)\s*(->[^:]*)?:[ \t]*\n")
    head = colon.search(text, m.end())
    if head is None:
        raise AnchorError(f"{path}: cannot find the end of the signature of {function}")
    body_start = head.end()
    nxt = re.compile(rf"^{indent}(?=\S)", re.MULTILINE).search(text, body_start)  # next line at the def's level
    end = nxt.start() if nxt else len(text)
    body_indent = re.match(r"[ \t]*", text[body_start:]).group(0)  # type: ignore[union-attr]
    return body_start, end, body_indent


def apply_edit(root: Path, edit: Edit) -> None:
    file = root / edit.path
    if not file.exists():
        raise AnchorError(f"{edit.path}: the file is gone")
    text = file.read_text()
    start, end, indent = function_span(text, edit.function, edit.path)
    new = edit.new.format(indent=indent)
    body = text[start:end]
    if edit.old is None:
        doc = re.match(rf'{indent}(""".*?"""|\'\'\'.*?\'\'\')[ \t]*\n', body, re.DOTALL)
        at = start + (doc.end() if doc else 0)
        text = text[:at] + new + "\n" + text[at:]
    else:
        i = body.find(edit.old)
        if i < 0:
            raise AnchorError(f"{edit.path}: {edit.old!r} not found in {edit.function}()")
        text = text[:start] + body[:i] + new + body[i + len(edit.old):] + text[end:]
    file.write_text(text)


def fresh_copy(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in ("kvserve", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def run_pytest(cwd: Path, args: tuple[str, ...]) -> tuple[int, float, str]:
    cmd = [sys.executable, "-m", "pytest", *args, "-x", "-q", "-p", "no:cacheprovider",
           "-o", f"timeout={PER_TEST_TIMEOUT_S}"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env,
                              check=False)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = -9, f"the whole run exceeded {RUN_TIMEOUT_S} s\n{exc.stdout or ''}"
    return code, time.monotonic() - t0, output


def how(code: int, output: str) -> str:
    if code == 0:
        return "NOT CAUGHT"
    if code == -9 or "Timeout" in output:
        return "caught (timeout)"
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return f"caught: {failed[0]}" if failed else f"caught (exit {code})"


def check_imports_the_copy(root: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import kvserve; print(kvserve.__file__)"], cwd=root,
                         capture_output=True, text=True, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"the copy imports kvserve from {out}, not from {root}: the check would test the "
                         f"unmodified code")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", nargs="*", type=int, help="mutation numbers (1-based); default: all")
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run on the unmodified copy")
    args = ap.parse_args(argv)
    chosen = [(i, m) for i, m in enumerate(MUTATIONS, 1) if not args.which or i in args.which]
    if args.list:
        for i, m in chosen:
            print(f"{i}. {m.name}: " + "; ".join(" ".join(t) for t in m.targets))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvserve-mutation-") as tmp:
        base = Path(tmp) / "base"
        fresh_copy(base)
        check_imports_the_copy(base)
        # every anchor first: a refactor that moved one fails before any long run
        for i, m in chosen:
            probe = Path(tmp) / f"probe-{i}"
            fresh_copy(probe)
            try:
                for e in m.edits:
                    apply_edit(probe, e)
            except AnchorError as exc:
                print(f"mutation {i} ({m.name}): anchor not found: {exc}", file=sys.stderr)
                return 2
            shutil.rmtree(probe)
        if not args.no_baseline:
            targets = sorted({t for _, m in chosen for t in m.targets})
            for t in targets:
                code, secs, output = run_pytest(base, t)
                if code != 0:
                    print(output[-4000:], file=sys.stderr)
                    print(f"baseline: {' '.join(t)} fails without any mutation (exit {code}); fix that first",
                          file=sys.stderr)
                    return 2
                print(f"baseline ok  {' '.join(t)}  ({secs:.0f} s)", flush=True)
        rows: list[tuple[int, str, str, str, float]] = []
        for i, m in chosen:
            work = Path(tmp) / f"m{i}"
            fresh_copy(work)
            for e in m.edits:
                apply_edit(work, e)
            for t in m.targets:
                code, secs, output = run_pytest(work, t)
                rows.append((i, m.name, " ".join(t), how(code, output), secs))
                print(f"{i}. {m.name} | {' '.join(t)} | {rows[-1][3]} | {secs:.0f} s", flush=True)
            shutil.rmtree(work)
    print("\n| # | planted bug | tests run | result | time |\n|---|---|---|---|---|")
    for i, name, target, result, secs in rows:
        print(f"| {i} | {name} | `{target}` | {result} | {secs:.0f} s |")
    missed = [r for r in rows if r[3] == "NOT CAUGHT"]
    print(f"\n{len(rows) - len(missed)} of {len(rows)} checks caught their mutation")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
