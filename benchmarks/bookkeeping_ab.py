"""Per-request step bookkeeping, A/B in one process: ``runner.inputs`` (``build_inputs`` for a
batch of decodes, ``slots_for`` over a long prompt) as at git revision REV against the working
tree, and one token's two incremental-detokenizer decodes through transformers' ``decode``
against the Rust tokenizer's (``engine.detokenizer.decoder_of``). Prints medians in µs.

    PYTHONPATH=$PWD python benchmarks/bookkeeping_ab.py --rev 61e8025   # before session 15's change
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.contract import ScheduledChunk
from kvserve.engine.detokenizer import decoder_of
from kvserve.model.loader import load_tokenizer
from kvserve.runner import inputs as new

TOKENIZER = ROOT / "kvserve" / "assets" / "models" / "kvserve-tiny-chat"


def module_at(rev: str, path: str):
    src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    f = Path(tempfile.mkdtemp()) / "inputs_at_rev.py"
    f.write_text(src)
    spec = importlib.util.spec_from_file_location("inputs_at_rev", f)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["inputs_at_rev"] = mod
    spec.loader.exec_module(mod)
    return mod


def median_us(fn, n: int = 200, rounds: int = 5) -> float:
    out = []
    for _ in range(rounds):
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out.append(statistics.median(ts))
    return 1e6 * statistics.median(out)


class _State:  # the two fields build_inputs reads
    def __init__(self, tokens: list[int], prompt: int) -> None:
        self.token_ids, self.num_prompt_tokens = tokens, prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    old = module_at(args.rev, "kvserve/runner/inputs.py")
    b, ctx, bs = args.batch, args.context, 16
    states = {f"r{i}": _State(list(range(ctx + 1)), ctx) for i in range(b)}
    chunks = [ScheduledChunk(request_id=f"r{i}", start=ctx, num_new_tokens=1, new_token_ids=[1],
                             block_ids=list(range(i * 40, i * 40 + ctx // bs + 1)), num_sample=1) for i in range(b)]
    cpu = torch.device("cpu")
    table = list(range(200))
    tok = load_tokenizer(TOKENIZER)
    fast = decoder_of(tok)
    ids = tok.encode("The quick brown fox jumps over the lazy dog again and again, token by token.")
    rows = {
        f"build_inputs, {b} decodes": (lambda: old.build_inputs(chunks, states, bs, None, cpu),
                                       lambda: new.build_inputs(chunks, states, bs, None, cpu)),
        "slots_for, 2,048 positions": (lambda: old.slots_for(table, 0, 2048, bs),
                                       lambda: new.slots_for(table, 0, 2048, bs)),
        "one token's two decodes": (lambda: (tok.decode(ids[-6:-1], skip_special_tokens=True),
                                             tok.decode(ids[-6:], skip_special_tokens=True)),
                                    lambda: (fast(ids[-6:-1], skip_special_tokens=True),
                                             fast(ids[-6:], skip_special_tokens=True))),
    }
    print(f"{'µs (median)':32s} {'before (' + args.rev + ')':>16s} {'now':>10s}")
    for name, (before, now) in rows.items():
        print(f"{name:32s} {median_us(before):16.2f} {median_us(now):10.2f}")


if __name__ == "__main__":
    main()
