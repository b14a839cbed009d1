"""Precision per layer on the shipped chat model: the map each KL budget picks, what it costs, what it buys.

One calibration run (the engine's default text: 4 held-out texts × 256 tokens, 16 per step) measures
every (layer, side, codec) once, then chooses for each budget (``kvserve.eval.calibrate.calibrate``,
the engine's own code). Per budget: the map, bytes/token, tokens/GiB and the gain against bf16,
the joint KL measured on the calibration text; then ``kvserve eval kv``'s measurement of each
chosen map (8 held-out texts × 512 tokens, 1 token per step, no greedy test) as a cross-check on
more text.

    python benchmarks/kv_calibration.py                  # budgets 1e-4,3e-4,1e-3,1e-2
    python benchmarks/kv_calibration.py --no-eval        # calibration only (35 s on 2 cores)

Prints a table (and the CPU) and writes JSON (default ``benchmarks/results/kv_calibration.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.bench.machine import cpu_info
from kvserve.config import CacheConfig, EngineConfig
from kvserve.engine.llm import resolve_model_path
from kvserve.eval.calibrate import (
    CalibrationText,
    Calibrator,
    calibrate,
    calibration_config,
    heldout_sequences,
)
from kvserve.eval.kv_quality import EvalConfig, run_eval
from kvserve.kv.layout import model_kv_bytes_per_token
from kvserve.model.loader import load_model_config, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="1e-4,3e-4,1e-3,1e-2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "kv_calibration.json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    cpu = cpu_info()
    print(f"CPU: {cpu}", file=sys.stderr)
    chat = resolve_model_path(None)
    model, cache, text = load_model_config(chat), CacheConfig(), CalibrationText()
    full = model_kv_bytes_per_token(model, model.dtype, cache.block_size)
    t0 = time.perf_counter()
    cal = Calibrator(calibration_config(EngineConfig(model=chat, num_threads=args.threads), text, full),
                     heldout_sequences(load_tokenizer(chat), text), text.chunk)
    rows = []
    for b in (float(x) for x in args.budgets.split(",")):
        r = calibrate(cal, b, model, cache)
        rows.append({"budget_kl": b, "kv_dtype": r.kv_dtype, "layers": r.layers, "joint_kl": r.joint_kl,
                     "summed_kl": r.summed_kl, "bytes_per_token": r.bytes_per_token,
                     "tokens_per_gib": 2**30 // r.bytes_per_token, "gain_vs_bf16": full / r.bytes_per_token})
    seconds = time.perf_counter() - t0
    singles = r.singles  # every budget shares the one set of single measurements
    evals: dict[str, object] = {}
    if not args.no_eval:
        names = tuple(dict.fromkeys(row["kv_dtype"] for row in rows))
        rep = run_eval(EvalConfig(model=chat, codecs=names, greedy_prompts=0, num_threads=args.threads),  # type: ignore[arg-type]
                       log=lambda s: print(s, file=sys.stderr))
        evals = {k: {"kl": v.kl, "delta_ppl_pct": v.delta_ppl_pct, "top1": v.top1_agreement} for k, v in rep.codecs.items()}
    print(f"{'budget':>8} {'joint KL':>9} {'B/token':>8} {'tokens/GiB':>11} {'×bf16':>6} {'eval KL':>9}  map")
    for row in rows:
        ev = evals.get(str(row["kv_dtype"]), {})
        kl = f"{ev['kl']:.2e}" if ev else "-"  # type: ignore[index]
        print(f"{row['budget_kl']:>8g} {row['joint_kl']:>9.2e} {row['bytes_per_token']:>8} "
              f"{row['tokens_per_gib']:>11,} {row['gain_vs_bf16']:>6.2f} {kl:>9}  {row['kv_dtype']}")
    print(f"bf16: {full} B/token, {2**30 // full:,} tokens/GiB; calibration {seconds:.1f} s, "
          f"{cal.measured} passes over {sum(map(len, cal.sequences))} tokens")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cpu": cpu, "model": chat, "text": asdict(text),
                                     "bf16_bytes_per_token": full, "calibration_seconds": seconds,
                                     "passes": cal.measured, "budgets": rows, "singles": singles,
                                     "eval_kv": evals}, indent=1))
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
