"""KV codecs side by side: decode time and tokens held per GiB, against bf16, in one run.

On the random-weight Qwen2.5-0.5B-shaped checkpoint (made once with ``kvserve make-model``), one
engine per codec, all sharing the one loaded model (quantized from the first token:
``kv_quant_min_tokens=0``). For each codec, ``--batch`` sequences are prefilled to each context in
``--contexts`` (extending the same sequences: 256 → 1024 → 4096), then every codec decodes
``--steps`` steps round-robin (one token per sequence per step, as the engine's runner does; the
order rotates each round so background load hits all codecs alike). Reported per codec and context:

* ``step_ms``: median wall time of one decode step (the whole model, logits included);
* ``ms_per_token``: ``step_ms / batch``;
* ``attn_ms``: median time of layer 0's paged attention in such a step (write + gather/decode +
  SDPA), isolating the KV read path the codec changes; NaN where there was no such call to time
  (since session 12 a small step runs every layer in one native call, kvserve/model/decode_stack.py,
  and a float pool's layer goes through the fused prologue, ``forward_qkv``);
* ratios of each against bf16 at the same context, and the paired ratio: each round's step
  against bf16's step of the same round, median with a 95 % interval and the share of rounds the
  codec was faster (what settles a codec within a few percent of bf16 on a drifting host);
* ``bytes_per_token`` and ``tokens_per_gib`` (``2^30 // bytes_per_token``), and their ratio to bf16.

    python benchmarks/kv_quant.py                         # contexts 256,1024,4096; batch 4
    python benchmarks/kv_quant.py --quick                 # batch 2, contexts 256,1024, 4 steps
    python benchmarks/kv_quant.py --codecs "bf16;int8" --contexts 512,2048 --batch 16 \
        --kv-cache-memory 536870912 --fill synthetic     # contexts written as random K/V: seconds

The machine is shared and noisy (2 cores, other jobs running): figures are medians, and the
ratios against bf16 (measured in the same run, interleaved per context) are what to read.
Prints a table and writes JSON (default ``benchmarks/results/kv_quant.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import torch

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache"
sys.path.insert(0, str(ROOT))

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.contract import ScheduledChunk, SchedulerOutput
from kvserve.engine.engine import LLMEngine
from kvserve.request import Request, RequestStatus
from kvserve.runner.model_runner import torch_dtype
from kvserve.sampling_params import SamplingParams

DEFAULT_CODECS = ("bf16", "fp8", "int8", "int4", "k:int8,v:int4")


def ensure_model(path: Path) -> Path:
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kvserve.cli", "make-model", "--preset", "qwen2.5-0.5b",
                        "--out", str(path)], check=True)
    return path


class FillKV(torch.nn.Module):
    """Stands in for the model during a synthetic prefill: writes random K/V (unit normal, model
    dtype) into every layer through the layer's own ``write`` (so codecs encode as in serving) and
    returns zero hidden states. Decode timing does not depend on the values, and this fills
    16 x 2,048 tokens in seconds instead of minutes of prefill."""

    def __init__(self, real: torch.nn.Module, kv_heads: int, head_dim: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.real = real
        self.kv_heads, self.head_dim, self.hidden, self.dtype = kv_heads, head_dim, hidden, dtype

    def forward(self, input_ids, positions, layers, meta):  # type: ignore[no-untyped-def]
        from kvserve.kv.layer_kv import as_layer_kv

        t = input_ids.shape[0]
        for layer in layers:
            k = torch.randn(t, self.kv_heads, self.head_dim).to(self.dtype)
            v = torch.randn(t, self.kv_heads, self.head_dim).to(self.dtype)
            as_layer_kv(layer).write(k, v, meta.slot_mapping)
        return torch.zeros(t, self.hidden, dtype=self.dtype)


class Driver:
    """Feeds ``batch`` sequences through an engine's KV manager and runner directly."""

    def __init__(self, engine: LLMEngine, batch: int, vocab: int, seed: int = 0, synthetic: bool = False) -> None:
        self.engine = engine
        self.synthetic = synthetic
        g = torch.Generator().manual_seed(seed)
        self.reqs = [Request(f"b{i}", torch.randint(10, vocab, (1,), generator=g).tolist(),
                             SamplingParams(max_tokens=1)) for i in range(batch)]
        self.g = g
        self.vocab = vocab

    def _step(self, n: int, logits: bool) -> float:
        chunks = []
        for r in self.reqs:
            missing = r.num_computed_tokens + n - r.num_tokens
            if missing > 0:
                r.prompt_token_ids.extend(torch.randint(10, self.vocab, (missing,), generator=self.g).tolist())
            if not self.engine.kv.allocate_slots(r, n):
                raise RuntimeError("KV pool too small for the benchmark; raise --kv-cache-memory")
            start = r.num_computed_tokens
            chunks.append(ScheduledChunk(r.request_id, start, n, r.all_token_ids[start:start + n],
                                         list(self.engine.kv.block_table(r.request_id))))
        out = SchedulerOutput(chunks=chunks, block_ops=self.engine.kv.take_block_ops())
        t0 = time.perf_counter()
        with torch.inference_mode():
            if logits:
                self.engine.runner.score(out)
            else:
                self.engine.runner.forward(out)
        dt = time.perf_counter() - t0
        for r in self.reqs:
            r.num_computed_tokens += n
        return dt

    def prefill_to(self, context: int, chunk: int = 512) -> None:
        runner = self.engine.runner
        real = runner.model
        if self.synthetic:
            c = self.engine.model_config
            runner.model = FillKV(real, c.num_key_value_heads, c.head_dim, c.hidden_size, torch_dtype(c.dtype))
        try:
            while self.reqs[0].num_computed_tokens < context:
                self._step(min(chunk, context - self.reqs[0].num_computed_tokens), logits=False)
        finally:
            runner.model = real

    def decode(self, steps: int) -> list[float]:
        return [self._step(1, logits=True) for _ in range(steps)]

    def close(self) -> None:
        for r in self.reqs:
            r.status = RequestStatus.FINISHED_ABORTED
            self.engine.kv.free(r)


class AttentionTimer:
    """Times layer 0's attention call (write + read of the KV, whatever the backend) per step by
    wrapping the engine's attention backend; every ``num_layers``-th call is layer 0's."""

    def __init__(self, engine: LLMEngine) -> None:
        self.times: list[float] = []
        self.backend = engine.runner.attention
        self.layers = engine.model_config.num_hidden_layers
        self.calls = 0

    def __enter__(self) -> Self:
        orig = type(self.backend).forward

        def timed(q, k, v, kv_cache, meta, scale):  # type: ignore[no-untyped-def]
            first = self.calls % self.layers == 0
            self.calls += 1
            t0 = time.perf_counter()
            out = orig(self.backend, q, k, v, kv_cache, meta, scale)
            if first:
                self.times.append(time.perf_counter() - t0)
            return out

        self.backend.forward = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.backend.forward


def make_engines(model: Path, codecs: list[str], contexts: list[int], batch: int, steps: int, memory: int,
                 threads: int | None, attention_backend: str = "auto") -> dict[str, LLMEngine]:
    """One engine per codec, all sharing one loaded model (same weights object, same memory)."""
    import kvserve.model.loader as engine_mod  # build_inline_runner imports load_model from here

    loaded: dict[str, object] = {}
    real_load = engine_mod.load_model

    def load_once(path, dtype="auto", device="cpu"):  # type: ignore[no-untyped-def]
        if "m" not in loaded:
            loaded["m"] = real_load(path, dtype=dtype, device=device)
        return loaded["m"]

    engines = {}
    engine_mod.load_model = load_once  # type: ignore[assignment]
    try:
        for codec in codecs:
            cache = CacheConfig(block_size=16, kv_cache_memory=memory, kv_cache_dtype=codec,
                                enable_prefix_caching=False, kv_quant_min_tokens=0)
            sched = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=4096,
                                    max_model_len=max(contexts) + 2 * steps + 8)
            engines[codec] = LLMEngine(EngineConfig(model=str(model), cache=cache, scheduler=sched,
                                                    num_threads=threads, attention_backend=attention_backend))
            assert engines[codec].runner.kv_bytes == engines[codec].capacity.allocated_bytes
    finally:
        engine_mod.load_model = real_load  # type: ignore[assignment]
    return engines


def run_all(engines: dict[str, LLMEngine], contexts: list[int], batch: int, steps: int,
            synthetic: bool = False) -> dict[str, dict[str, object]]:
    """Per context: prefill every codec's sequences, then decode round-robin across codecs (the
    order rotates each round), so load from other jobs hits every codec alike."""
    drivers = {c: Driver(e, batch, min(e.model_config.vocab_size, 50000), synthetic=synthetic)
               for c, e in engines.items()}
    results: dict[str, dict[str, object]] = {}
    for codec, e in engines.items():
        cap = e.capacity
        results[codec] = {"kv_dtype": e.kv_dtype, "bytes_per_token": cap.bytes_per_token,
                          "tokens_per_gib": 2**30 // cap.bytes_per_token, "window_bytes": cap.window_bytes,
                          "contexts": {}}
    names = list(engines)
    try:
        for ctx in contexts:
            step_t: dict[str, list[float]] = {c: [] for c in names}
            attn_t: dict[str, list[float]] = {c: [] for c in names}
            for c in names:
                drivers[c].prefill_to(ctx)
                drivers[c].decode(1)  # warm-up at this context
            for i in range(steps):
                for c in names[i % len(names):] + names[:i % len(names)]:
                    with AttentionTimer(engines[c]) as at:
                        step_t[c].extend(drivers[c].decode(1))
                    attn_t[c].extend(at.times)
            for c in names:
                step = statistics.median(step_t[c]) * 1e3
                # no layer-0 attention call to time when the native layer loop ran the step
                attn = statistics.median(attn_t[c]) * 1e3 if attn_t[c] else float("nan")
                results[c]["contexts"][str(ctx)] = {  # type: ignore[index]
                    "step_ms": step, "ms_per_token": step / batch, "attn_ms": attn,
                    "step_samples_ms": [t * 1e3 for t in step_t[c]]}
                print(f"  {c:<14} ctx {ctx:>5}: step {step:8.1f} ms  attn(layer 0) {attn:.2f} ms", file=sys.stderr,
                      flush=True)
    finally:
        for d in drivers.values():
            d.close()
    return results


def add_ratios(results: dict[str, dict[str, object]], base: str) -> None:
    ref = results[base]
    for r in results.values():
        r["tokens_per_gib_vs_bf16"] = r["tokens_per_gib"] / ref["tokens_per_gib"]  # type: ignore[operator]
        for ctx, m in r["contexts"].items():  # type: ignore[union-attr]
            b = ref["contexts"][ctx]  # type: ignore[index]
            m["step_vs_bf16"] = m["step_ms"] / b["step_ms"]
            m["attn_vs_bf16"] = m["attn_ms"] / b["attn_ms"]
            m["paired_vs_bf16"] = paired_ratio(m["step_samples_ms"], b["step_samples_ms"])


def paired_ratio(xs: list[float], base: list[float]) -> dict[str, float]:
    """Round i's step against the base codec's step of the same round (the two ran back to back),
    so drift of the host between rounds cancels: the median of the n ratios, a distribution-free
    95 % interval for it (order statistics n/2 -+ 0.98 sqrt(n), as a sign test), and the share
    of rounds in which this codec was the faster."""
    r = sorted(x / b for x, b in zip(xs, base))
    n = len(r)
    half = 0.98 * n ** 0.5
    lo, hi = max(0, int(n / 2 - half)), min(n - 1, int(n / 2 + half + 0.999))
    return {"median": statistics.median(r), "ci95_low": r[lo], "ci95_high": r[hi],
            "faster_share": sum(x < 1.0 for x in r) / n, "rounds": n}


def paired_text(p: dict[str, float]) -> str:
    """A paired ratio as ``median (low-high)``, its 95 % interval in brackets."""
    return f"{p['median']:.3f} ({p['ci95_low']:.3f}-{p['ci95_high']:.3f})"


def table(results: dict[str, dict[str, object]], contexts: list[int]) -> str:
    head = f"{'codec':<16} {'B/token':>8} {'tok/GiB':>9} {'×bf16':>6}"
    for c in contexts:
        head += f" | ctx {c:>5}: {'ms/tok':>7} {'×bf16':>6} {'paired (95% CI)':>17} {'attn ms':>7} {'×bf16':>6}"
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        line = f"{name:<16} {r['bytes_per_token']:>8} {r['tokens_per_gib']:>9} {r['tokens_per_gib_vs_bf16']:>6.2f}"
        for c in contexts:
            m = r["contexts"][str(c)]  # type: ignore[index]
            p = m["paired_vs_bf16"]
            ci = paired_text(p)
            line += (f" | {'':>10} {m['ms_per_token']:>7.1f} {m['step_vs_bf16']:>6.2f} {ci:>17} "
                     f"{m['attn_ms']:>7.2f} {m['attn_vs_bf16']:>6.2f}")
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "qwen2.5-0.5b")
    ap.add_argument("--codecs", default=";".join(DEFAULT_CODECS), help="';'-separated KV codecs; bf16 first")
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="decode steps measured per context")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes per engine")
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (the machine's 2 cores)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--attention-backend", default="auto", help="auto, torch_sdpa or native")
    ap.add_argument("--fill", choices=("model", "synthetic"), default="model",
                    help="model: prefill the contexts through the model; synthetic: write random K/V "
                         "through each layer's cache write (seconds instead of minutes; decode unchanged)")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "kv_quant.json")
    a = ap.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",")]
    if a.quick:
        a.batch, a.steps, contexts = 2, 4, [c for c in contexts if c <= 1024]
    codecs = [c.strip() for c in a.codecs.split(";") if c.strip()]
    if codecs[0] != "bf16":
        codecs.insert(0, "bf16")
    model = ensure_model(a.model)
    t0 = time.time()
    engines = make_engines(model, codecs, contexts, a.batch, a.steps, a.kv_cache_memory, a.threads,
                           a.attention_backend)
    results = run_all(engines, contexts, a.batch, a.steps, synthetic=a.fill == "synthetic")
    add_ratios(results, "bf16")
    print(table(results, contexts))
    from kvserve.bench.machine import cpu_info
    from kvserve.native.choices import choices

    doc = {"model": str(model), "cpu": cpu_info(), "attention_backend": a.attention_backend, "fill": a.fill,
           "attention_choices": [c.__dict__ for c in choices()], "batch": a.batch, "steps": a.steps, "contexts": contexts,
           "threads": torch.get_num_threads(), "wall_s": round(time.time() - t0, 1), "codecs": results}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    print(f"wrote {a.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
