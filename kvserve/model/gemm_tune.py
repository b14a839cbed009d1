"""Time each GEMM path on a model's matrix shapes, at 1, 16, 64, 96 and 256 rows (:data:`BAND_ROWS`).

Weights are synthetic (the model's shapes and dtype, a constant value: GEMM time does not depend
on the values), so a model can be measured before its checkpoint is read and the planner can
measure a shape it only knows from a config. Per row count the working set is bounded in weight
elements: at one, 16, 64 and 96 rows (:func:`decode_working_set`), distinct copies of the matrix run in
turn until they exceed the last-level cache 1.5 times (a decode step streams every layer's weights
from memory, so one matrix timed in a loop would measure the cache instead), but never more than
the whole model (a model that fits in the cache decodes from it), and a matrix larger than that is
cut to its first output rows (GEMM time scales with them); at 256 rows the cut is
:data:`PREFILL_WORKING_SET` so one timing costs milliseconds. (A fixed 32 MiB working set, sized
for a 32 MiB L3, measured a 480 MiB-L3 Xeon's cache: torch's one-row logits 11.3 ms there, 17 ms in
a real decode step.) Each path: a warm-up call, then the median of :data:`REPEATS` passes; a
path whose first pass is more than :data:`ABORT_RATIO` times the best so far is not timed again.
The 0.5B shape takes about 2 s on the 2-core EPYC (32 MiB L3), 29 s and 2.5 GB of scratch on the
2-core AMX Xeon (480 MiB L3); see docs/kernels.md.

Paths are timed one after another, so a drift of a shared host between them lands on one path
(on the session-10 EPYC the host's speed moved 1.5x within minutes, and one such drift put the
logits on oneDNN's copy in every band and timed the tiled MLP at 2.8x its speed). So where the
fastest paths of a row count (up to :data:`REMATCH_MAX`, two until session 18) are within
:data:`REMATCH_WITHIN` of the fastest, they are timed again in alternation (:func:`rematch`:
A B C D, D C B A ..., :data:`REMATCH_PASSES` passes each) and those medians replace their first
timings: a close call is decided on timings that shared the host's state.

Reported figures are microseconds per call on the role's full matrix (a cut matrix's time scaled
up by the rows cut). Invariant: every path of a role is timed on the same shapes and inputs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.model.gemm_paths import BAND_ROWS, build_linear, build_mlp

MIN_DECODE_WORKING_SET = 16 << 20
"""Weight elements per timed pass at 1, 16, 64 and 96 rows, at least (32 MiB in bf16; they share the
one-row matrices)."""
PREFILL_WORKING_SET = 1 << 20
"""Weight elements per timed pass at 256 rows."""
MAX_COPIES = 4096
REPEATS = 3
ABORT_RATIO = 3.0
REMATCH_WITHIN = 1.5
"""The paths of a row count within this ratio of its fastest are timed again, alternating."""
REMATCH_PASSES = 4
REMATCH_MAX = 4
"""Paths timed again at most (their modules are held at once: up to 4 working sets of scratch).
Session 18: a plan timed the tiled MLP fourth at one row (1,184 µs against 831, 903 and 905;
364-914 in other timings that day) and put the MLP on oneDNN's copy in every band, decode
included."""


@dataclass(frozen=True)
class RoleShape:
    """One role's matrices: ``(out, in)`` per matrix (the MLP has two: gate_up ``[2I, H]`` and
    down ``[H, I]``); ``count`` matrices of this role in the model (layers; 1 for the logits)."""

    role: str
    shapes: tuple[tuple[int, int], ...]
    count: int

    @property
    def elements(self) -> int:
        return sum(o * i for o, i in self.shapes)


def role_shapes(hidden: int, intermediate: int, q_size: int, kv_size: int, vocab: int,
                layers: int) -> tuple[RoleShape, ...]:
    """The four roles of a Llama-family decoder."""
    return (RoleShape("qkv", ((q_size + 2 * kv_size, hidden),), layers),
            RoleShape("o", ((hidden, q_size),), layers),
            RoleShape("mlp", ((2 * intermediate, hidden), (hidden, intermediate)), layers),
            RoleShape("lm_head", ((vocab, hidden),), 1))


def decode_working_set(roles: tuple[RoleShape, ...], dtype: torch.dtype, llc_bytes: int | None) -> int:
    """Weight elements per timed pass at 1, 16, 64 and 96 rows: 1.5x the last-level cache, capped at the
    model's own weights, at least :data:`MIN_DECODE_WORKING_SET`."""
    model = sum(r.elements * r.count for r in roles)
    past_cache = int(1.5 * (llc_bytes or 0)) // dtype.itemsize
    return max(MIN_DECODE_WORKING_SET, min(past_cache, model))


def _cut(rs: RoleShape, budget: int) -> tuple[tuple[tuple[int, int], ...], int, float]:
    """The shapes actually timed, how many distinct copies, and full/timed work (the scale-up)."""
    if rs.elements <= budget:
        return rs.shapes, max(1, min(MAX_COPIES, budget // rs.elements)), 1.0
    if rs.role == "mlp":
        (_, hidden), (_, inter) = rs.shapes
        width = max(64, budget // (3 * hidden)) // 8 * 8  # a multiple of 8, as every path accepts
        return ((2 * width, hidden), (hidden, width)), 1, inter / width
    (out, inp), = rs.shapes
    rows = max(64, budget // inp)
    return ((rows, inp),), 1, out / rows


def _modules(rs: RoleShape, path: str, weights: list[list[torch.Tensor]]) -> list[torch.nn.Module]:
    if rs.role == "mlp":
        return [build_mlp(path, *w) for w in weights]
    out_dtype = torch.float32 if rs.role == "lm_head" else None
    return [build_linear(path, w[0], None, out_dtype) for w in weights]


def _time_pass(mods: list[torch.nn.Module], x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for m in mods:
        m(x)
    return (time.perf_counter() - t0) / len(mods)


def rematch(times: dict[str, float], build: Callable[[str], list[torch.nn.Module]], x: torch.Tensor, scale: float,
            time_pass: Callable[[list[torch.nn.Module], torch.Tensor], float] | None = None) -> dict[str, float]:
    """``times`` ({path: us}) with its fastest paths, up to :data:`REMATCH_MAX` of those within
    :data:`REMATCH_WITHIN` of the fastest, timed again in alternation when there are two or more
    (``build(path)`` gives a path's modules; the order alternates A B C D, D C B A ...,
    :data:`REMATCH_PASSES` passes each, medians). Other entries unchanged."""
    ranked = sorted(times, key=times.__getitem__)
    pair = [p for p in ranked[:REMATCH_MAX] if times[p] <= REMATCH_WITHIN * times[ranked[0]]]
    if len(pair) < 2:
        return times
    run = time_pass or _time_pass
    mods = {p: build(p) for p in pair}
    passes: dict[str, list[float]] = {p: [] for p in pair}
    with torch.inference_mode():
        for p in pair:
            run(mods[p][:1], x)  # warm
        for i in range(REMATCH_PASSES):
            for p in (pair if i % 2 == 0 else pair[::-1]):
                passes[p].append(run(mods[p], x))
    return {**times, **{p: statistics.median(v) * 1e6 * scale for p, v in passes.items()}}


def _time(mods: list[torch.nn.Module], x: torch.Tensor, scale: float, best_us: float | None) -> float:
    with torch.inference_mode():
        _time_pass(mods[:1], x)                                   # warm: thread pool, first touch
        passes = [_time_pass(mods, x)]
        if best_us is None or passes[0] * 1e6 * scale <= ABORT_RATIO * best_us:
            passes += [_time_pass(mods, x) for _ in range(REPEATS - 1)]
    return statistics.median(passes) * 1e6 * scale


Timer = Callable[[RoleShape, int, str, torch.dtype], float]


def _set_inline(mods: list[torch.nn.Module], inline: bool) -> None:
    for m in mods:
        m.inline = inline  # type: ignore[assignment]


def time_role(rs: RoleShape, rows: tuple[int, ...], paths: tuple[str, ...],
              dtype: torch.dtype, working_set: int) -> dict[int, dict[str, float]]:
    """``{rows: {path: us}}`` for role ``rs`` on ``working_set`` weight elements per pass (every
    row count given shares them).

    The weights are built once per path and timed at each row count. ``fbgemm_fp16_x1`` is timed
    on the ``fbgemm_fp16_xN`` modules with their shards run one after another on the calling
    thread (the same GEMMs, one packing instead of two; FBGEMM's time per row block is linear)."""
    shapes, copies, scale = _cut(rs, working_set)
    weights = [[torch.full(s, 0.01, dtype=dtype) for s in shapes] for _ in range(copies)]  # values don't matter
    x = {r: torch.randn(r, shapes[0][1], generator=torch.Generator().manual_seed(0)).to(dtype) for r in rows}
    sharded = next((p for p in paths if p.startswith("fbgemm_fp16_x") and p != "fbgemm_fp16_x1"), None)
    out: dict[int, dict[str, float]] = {r: {} for r in rows}
    kept: list[torch.nn.Module] = []  # the sharded modules, which x1 reuses; other paths' go when timed
    for path in paths:
        if path in (sharded, "fbgemm_fp16_x1") and sharded is not None:
            mods = kept = kept or _modules(rs, sharded, weights)
        else:
            mods = _modules(rs, path, weights)
        _set_inline(mods, path == "fbgemm_fp16_x1")
        for r in rows:
            best = min(out[r].values()) if out[r] else None
            out[r][path] = _time(mods, x[r], scale, best)
        _set_inline(mods, False)
        del mods
    kept = []

    def build(path: str) -> list[torch.nn.Module]:
        mods = _modules(rs, sharded if path == "fbgemm_fp16_x1" and sharded is not None else path, weights)
        _set_inline(mods, path == "fbgemm_fp16_x1")
        return mods

    for r in rows:
        out[r] = rematch(out[r], build, x[r], scale)
    return out


def measure(roles: tuple[RoleShape, ...], paths: tuple[str, ...], dtype: torch.dtype,
            timer: Timer | None = None) -> dict[str, list[dict[str, float]]]:
    """``{role: [ {path: us} for each band ]}``, bands in :data:`~kvserve.model.gemm_paths.BANDS`
    order. ``timer(role, rows, path, dtype) -> us`` replaces the measurement (tests)."""
    from kvserve.bench.machine import last_level_cache_bytes

    out: dict[str, list[dict[str, float]]] = {}
    decode_set = decode_working_set(roles, dtype, last_level_cache_bytes())
    for rs in roles:
        if timer is not None:
            out[rs.role] = [{p: timer(rs, r, p, dtype) for p in paths} for r in BAND_ROWS]
            continue
        got: dict[int, dict[str, float]] = {}
        for group, working_set in (((1, 16, 64, 96), decode_set), ((256,), PREFILL_WORKING_SET)):
            got.update(time_role(rs, group, paths, dtype, working_set))
        out[rs.role] = [got[r] for r in BAND_ROWS]
    return out
