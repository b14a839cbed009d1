"""Decode steps of one engine under variants switched in place, rounds alternating: the A/B
behind ``tiled_ab.py`` (two builds of a kernel) and ``band_ab.py`` (two GEMM plans' bands).

Both variants see the same weights, KV and sequences, and a drift of a noisy host hits both
alike (the session-10 EPYC's speed moved 1.5x within minutes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from throughput import prompt_ids

from kvserve import SamplingParams


def alternate(eng, batch: int, context: int, variants: dict[str, Callable[[], None]], rounds: int,
              steps: int) -> dict[str, list[float]]:
    """ms per engine step under each variant (``variants[name]()`` switches to it): ``batch``
    sequences of ``context`` prompt tokens, once every one decodes; per round each variant runs
    one untimed step, then ``steps`` timed ones, the order reversed every other round. The
    sequences are aborted afterwards, so the engine is empty again."""
    new = (steps + 1) * rounds * len(variants) + 8
    rids = [eng.add_request({"prompt_token_ids": prompt_ids(context, 100 + i)},
                            SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)) for i in range(batch)]
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in eng.step() if o.outputs[0].token_ids}
    ms: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(rounds):
        for name in (list(variants) if rnd % 2 == 0 else list(variants)[::-1]):
            variants[name]()
            eng.step()  # the switch's first step is not timed
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            ms[name].append((time.perf_counter() - t0) / steps * 1e3)
    for rid in rids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return ms


def medians(ms: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in ms.items()}


def model_switches(eng, models: dict[str, Any]) -> dict[str, Callable[[], None]]:
    """For :func:`alternate`: one switch per model, each making the engine's runner run that model
    (copies of one checkpoint loaded differently) from the next step."""
    def switch(model: Any) -> Callable[[], None]:
        def run() -> None:
            eng.runner.model = model
        return run
    return {name: switch(m) for name, m in models.items()}


def by_batch(eng, sizes: list[int], context: int, variants: dict[str, Callable[[], None]], rounds: int,
             steps: int) -> list[dict[str, Any]]:
    """:func:`alternate` at each batch size: rows of ``{batch, median_ms_per_step, runs_ms, ratio}``,
    ``ratio`` the first variant's median over the second's."""
    first, second = list(variants)[:2]
    rows = []
    for b in sizes:
        ms = alternate(eng, b, context, variants, rounds, steps)
        med = medians(ms)
        rows.append({"batch": b, "median_ms_per_step": med, "runs_ms": ms, "ratio": med[first] / med[second]})
    return rows


def print_rows(rows: list[dict[str, Any]], title: str) -> None:
    """A table of :func:`by_batch`'s rows: ms per step of each variant and the ratio."""
    names = list(rows[0]["median_ms_per_step"]) if rows else []
    print(f"\n{title}")
    print(f"{'batch':>6} " + " ".join(f"{n:>{max(12, len(n))}}" for n in names) + f" {'ratio':>7}")
    for r in rows:
        m = r["median_ms_per_step"]
        print(f"{r['batch']:>6} " + " ".join(f"{m[n]:>{max(12, len(n))}.2f}" for n in names) + f" {r['ratio']:>7.3f}")
