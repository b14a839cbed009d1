"""Which GEMM path each role of a model runs in each row band, on this machine.

:func:`plan_for` answers, in order:

1. ``KVSERVE_GEMM=<path>`` (or the loader's ``cpu_fp16_gemm=True/False``): that path everywhere
   (source ``forced``);
2. models too small to matter (under :data:`TUNE_MIN_ELEMENTS` weight elements, e.g. the tests'
   tiny models; the embedded chat model is above it) and fp32 models: a default from the CPU
   flags, without timing (source ``default``):
   ``native`` where the CPU multiplies half precision natively (AMX or AVX-512 BF16/FP16), else
   FBGEMM fp16 (fp32 models: always ``native``, packing would round their weights);
3. a plan cached in ``<cache dir>/gemm/<key>.json``, keyed by CPU model and flags, torch version,
   thread count, OpenMP wait policy, dtype, the role shapes and the tiled kernel's source and its AMX switch (source ``cached``), unless ``KVSERVE_RETUNE_KERNELS=1``
   (``--retune-kernels`` on serve/generate) asks for a new measurement;
4. otherwise the paths are timed (:mod:`kvserve.model.gemm_tune`) and the result cached (source
   ``measured``); a role whose plan would run one-row steps off the loaded tensor although a path
   on it was the fastest there is timed once more first, each timing the least of the two
   (:func:`_confirmed`: one noisy band can otherwise move a role's storage and every decode step).

From timings, each role first takes one storage for every band
(:func:`~kvserve.model.gemm_paths.storage_of`: ``native`` and ``kvserve_tiled`` share the loaded
tensor, so a split between them is free), each band on that storage's fastest path: the storage
whose worst slowdown against each band's fastest is smallest. (Until session 9 this step took one
*path*, so the tiled kernel's one-row speed and torch's many-row speed on the same tensor were
never weighed together: on an AVX-512 AMD EPYC it put every role on ``onednn_packed``, 1.4-1.5x
the tiled kernel's one-row time on the MLP and the logits.) When a path of another storage is at
least :data:`SPLIT_MIN_GAIN` faster in some band, keeping both costs that role's weights once more
per extra storage; such splits are allowed, the most gain per extra byte first, up to ``KVSERVE_GEMM_EXTRA_MIB`` (default
:data:`EXTRA_BYTES_DEFAULT`: the memory target is weights + KV pool + 300 MiB, most of which the
runtime itself takes; on the 0.5B shape one copy of the MLPs is 598 MiB, of the logits 260 MiB).
That is done once per thread family (:data:`FAMILIES`: OpenMP-threaded paths and FBGEMM's pool
shards do not share a plan), and the family plan whose slowest band, summed over the forward's
matrices, is closest to the best family's wins.

Every decision is recorded in :mod:`kvserve.native.choices` (role ``gemm_<role>``) and logged.
Invariant: a plan names one path per (role, band), each one of :func:`candidate_paths`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.config import parse_size
from kvserve.model.cpu_gemm import fbgemm_fp16_available
from kvserve.model.gemm_paths import BANDS, ROLES, candidate_paths, storage_of
from kvserve.model.gemm_tune import RoleShape, Timer, measure
from kvserve.native import CSRC, cache_dir, wait_policy
from kvserve.native import march as native_march
from kvserve.native.choices import KernelChoice, record

log = logging.getLogger("kvserve.gemm")
TUNE_MIN_ELEMENTS = 4 << 20
"""Below this many weight elements a model runs the default path untimed. Session 11 lowered it
from 32 Mi: the embedded chat model (5.6 M elements) had been left on torch's bf16 matmul; timed,
its decode steps took 0.43-0.71x the time on a Zen 4 EPYC (benchmarks/small_model_gemm.py), for a
few seconds of timing once per machine (cached)."""
EXTRA_BYTES_DEFAULT = 64 << 20
SPLIT_MIN_GAIN = 1.15
"""A second copy of a role is only worth its memory when some band runs this much faster on it
(smaller gains are within the measurement's noise on a shared machine)."""
TIE = 1.05
"""Timings this close (ratio) are a tie on a shared machine."""
STORAGE_TIE = 1.15
"""A role's storage is the one whose worst band is least slow against each band's fastest; the
loaded tensor (the checkpoint's own, read by torch's matmul and the tiled kernel) is kept when its
worst band is within this ratio of that: it costs no repack at load, a tied logits projection
reads the embedding itself, and on the session-12 Zen 4 EPYC two timings of one build, minutes
apart, put the 0.5B shape's MLP once on it (worst band 1.05x) and once on oneDNN's copy (loaded
1.66x at 256 rows against oneDNN's 1.60x at one row): a coin toss that decided every decode step."""
HALF_NATIVE_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}
CACHE_VERSION = 5  # 2: one-row timings past the last-level cache (gemm_tune.decode_working_set); 3: the 64-row band; 4: the 128-row band; 5: timings confirmed (_confirmed), so a plan cached from one noisy measurement is measured again


@dataclass(frozen=True)
class GemmPlan:
    """``paths[role]`` = the path of each band (:data:`BANDS` order); ``timings_us[role][band]`` =
    ``{path: us}`` where measured; ``source`` one of forced, default, cached, measured."""

    paths: dict[str, tuple[str, ...]]
    source: str
    timings_us: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    extra_bytes: int = 0

    def swaps_modules(self) -> bool:
        """Whether any role leaves torch's matmul in some band (FBGEMM, the tiled kernel, oneDNN's
        reordered weight): the loaded model's modules are then replaced
        (:func:`kvserve.model.gemm_apply.apply_plan`)."""
        return any(p != "native" for bands in self.paths.values() for p in bands)


def _cpu() -> dict[str, object]:
    from kvserve.bench.machine import cpu_info

    return cpu_info()


def default_path(dtype: torch.dtype) -> str:
    """Without timings: native where the CPU has half-precision matmul units or FBGEMM is absent,
    else FBGEMM fp16 (its size-based sharding)."""
    flags = set(_cpu()["flags"])  # type: ignore[arg-type]
    if dtype == torch.float32 or flags & set(HALF_NATIVE_FLAGS.get(dtype, ())) or not fbgemm_fp16_available():
        return "native"
    return "fbgemm_fp16"


def uniform(path: str, source: str) -> GemmPlan:
    return GemmPlan({r: (path,) * len(BANDS) for r in ROLES}, source)


def _fastest_on(band: dict[str, float], storage: str) -> str | None:
    """The band's fastest path among those on ``storage`` (None: none is)."""
    return min((p for p in band if storage_of(p) == storage), key=band.__getitem__, default=None)


def _on_storage(bands: list[dict[str, float]], storage: str) -> tuple[str, ...] | None:
    """The fastest path of each band among those on ``storage`` (a split between them is free:
    they read one tensor); None when some band has none."""
    picks = [_fastest_on(b, storage) for b in bands]
    return None if None in picks else tuple(picks)  # type: ignore[arg-type]


def _regret_of(bands: list[dict[str, float]], paths: tuple[str, ...]) -> float:
    """The worst slowdown of one path per band against each band's fastest."""
    return max(b[p] / min(b.values()) for b, p in zip(bands, paths))


def _pooled(path: str) -> bool:
    """FBGEMM sharded over kvserve's Python pool (``fbgemm_fp16_xN``, N > 1)."""
    return path.startswith("fbgemm_fp16_x") and path != "fbgemm_fp16_x1"


OPENMP_PATHS = ("native", "kvserve_tiled", "onednn_packed")
FAMILIES = (lambda p: not _pooled(p), lambda p: p not in OPENMP_PATHS)
"""Paths that may share a plan. OpenMP-threaded paths (torch's matmul, the tiled kernel, oneDNN's) and
FBGEMM's pool shards contend for the cores when mixed: OpenMP's workers spin after each region
while a pool thread wants the core (0.5B decode step on 2 cores: 106-110 ms mixed, 84 ms with
every role on the tiled kernel, though each role timed alone favoured the mix). Single-thread
FBGEMM (``_x1``) goes with either."""


def decide(timings: dict[str, list[dict[str, float]]], role_bytes: dict[str, int], extra_budget: int,
           source: str, role_counts: dict[str, int] | None = None) -> GemmPlan:
    """The plan these timings give (see the module doc); ``role_bytes`` = a role's weight bytes in
    the whole model (one more copy of them is what a second path costs), ``role_counts`` how many
    matrices of each role a forward runs (default 1). One plan per :data:`FAMILIES` entry; the one
    whose worst band (the forward's summed time against the best family's) is best wins."""
    counts = role_counts or {}
    plans: list[GemmPlan] = []
    for keep in FAMILIES:
        sub = {r: [{p: t for p, t in b.items() if keep(p)} for b in bands] for r, bands in timings.items()}
        if all(b for bands in sub.values() for b in bands):  # every band has a path of the family
            plan = _decide_family(sub, role_bytes, extra_budget)
            if plan not in plans:
                plans.append(plan)

    def band_total(plan: GemmPlan, b: int) -> float:
        return sum(counts.get(r, 1) * timings[r][b][plan.paths[r][b]] for r in timings)

    bands = range(len(next(iter(timings.values()))))  # BANDS, or as many as the timings give (tests)
    bests = [min(band_total(p, b) for p in plans) for b in bands]
    best = min(plans, key=lambda p: max(band_total(p, b) / bests[b] for b in bands))
    paths = _keep_layer_loop(best.paths, timings, counts, role_bytes, extra_budget)
    return GemmPlan(paths, source, timings, _extra_bytes(paths, role_bytes))


LAYER_ROLES = ("qkv", "o", "mlp")
LOOP_BANDS = 4
"""The bands whose steps the native layer loop runs (rows<=1 ... rows<=128: its MAX_ROWS)."""
LAYER_LOOP_SAVING_US = 100.0
"""What running a step's layers in kvserve's native loop saves per layer, in µs, taken low: the loop
(:mod:`kvserve.model.decode_stack`) runs only where every layer role of the step's band is on the
tiled kernel, and on the 0.5B shape (24 layers) it took a one-sequence decode step to 0.918x the
per-layer path's time (2.75 ms, 115 µs a layer) and a 16-sequence one to 0.945x (3.5 ms, 146 µs a
layer; ``python benchmarks/decode_stack.py``, session 16)."""


def _extra_bytes(paths: dict[str, tuple[str, ...]], role_bytes: dict[str, int]) -> int:
    """The bytes a plan holds beyond one copy of each role's weights."""
    return sum((len({storage_of(p) for p in ps}) - 1) * role_bytes.get(r, 0) for r, ps in paths.items())


def _keep_layer_loop(paths: dict[str, tuple[str, ...]], timings: dict[str, list[dict[str, float]]],
                     counts: dict[str, int], role_bytes: dict[str, int], budget: int) -> dict[str, tuple[str, ...]]:
    """``paths`` with each loop band's layer roles all on ``kvserve_tiled`` where the GEMM time that
    costs (summed over the forward's matrices) is less than the loop saves (:data:`LAYER_LOOP_SAVING_US`
    a layer) and the extra copies stay within ``budget``. Timings alone had put a layer role of a
    loop band on torch's matmul or oneDNN's copy for a few percent in five of the nine plans timed
    in session 16 (once the one-row band), taking those steps off the loop. A plan of FBGEMM's pool shards is left alone
    (the tiled kernel's OpenMP team and the pool do not mix: :data:`FAMILIES`)."""
    if not set(LAYER_ROLES) <= set(timings) or any(_pooled(p) for ps in paths.values() for p in ps):
        return paths
    layers = counts.get("qkv", 1)
    for b in range(min(LOOP_BANDS, len(timings["qkv"]))):
        off = [r for r in LAYER_ROLES if paths[r][b] != "kvserve_tiled"]
        if not off or any("kvserve_tiled" not in timings[r][b] for r in off):
            continue
        loss = sum(counts.get(r, 1) * (timings[r][b]["kvserve_tiled"] - timings[r][b][paths[r][b]]) for r in off)
        trial = {**paths, **{r: paths[r][:b] + ("kvserve_tiled",) + paths[r][b + 1:] for r in off}}
        if loss <= LAYER_LOOP_SAVING_US * layers and _extra_bytes(trial, role_bytes) <= budget:
            log.info("GEMM plan: band %s keeps the native layer loop (its layer roles %.0f µs a forward slower "
                     "on the tiled kernel)", BANDS[b] if b < len(BANDS) else b, loss)
            paths = trial
    return paths


def _band_best(band: dict[str, float], storage: str) -> str:
    """The band's fastest path, except that one on ``storage`` (the role's single path's) within
    :data:`TIE` of it is taken instead: a tie is not worth a second copy of the weights."""
    fastest = min(band.values())
    return min((p for p, t in band.items() if t <= fastest * TIE), key=lambda p: (storage_of(p) != storage, band[p]))


def _decide_family(timings: dict[str, list[dict[str, float]]], role_bytes: dict[str, int],
                   extra_budget: int) -> GemmPlan:
    """One family's plan: each role on its single storage, then the splits the budget allows (for a
    role: every band on its fastest path, or one more storage where it gains; the most gain per
    extra byte first, one option per role)."""
    paths: dict[str, tuple[str, ...]] = {}
    split: list[tuple[float, int, str, tuple[str, ...]]] = []
    for role, bands in timings.items():
        storages = list(dict.fromkeys(storage_of(p) for p in bands[0]))
        on = {s: t for s in storages if (t := _on_storage(bands, s)) is not None}
        regret = {s: _regret_of(bands, t) for s, t in on.items()}
        least = min(regret.values())
        # the loaded tensor wins a near tie (STORAGE_TIE): no repacked copy, and its one-row path
        single = min(on, key=lambda s: (regret[s] > least * STORAGE_TIE, s != "loaded", regret[s]))
        base = on[single]
        paths[role] = base
        options = {tuple(_band_best(b, single) for b in bands)}
        for other in storages:  # one more storage, where it is SPLIT_MIN_GAIN faster
            alt = [_fastest_on(b, other) for b in bands]
            options.add(tuple(p if p is not None and b[p0] >= b[p] * SPLIT_MIN_GAIN else p0
                              for b, p0, p in zip(bands, base, alt)))
        for option in options - {base}:
            gain = [b[p0] / b[p] for b, p0, p in zip(bands, base, option)]  # how much faster each band gets
            if max(gain) >= SPLIT_MIN_GAIN:
                cost = _extra_bytes({role: option}, role_bytes)
                split.append((-sum(g - 1 for g in gain) / max(cost, 1), cost, role, option))
    extra, taken = 0, set()
    for _, cost, role, option in sorted(split):  # the most gain per extra byte first
        if role not in taken and extra + cost <= extra_budget:
            paths[role], extra = option, extra + cost
            taken.add(role)
    return GemmPlan(paths, "family", {}, extra)


def _key(roles: tuple[RoleShape, ...], dtype: torch.dtype, paths: tuple[str, ...]) -> str:
    cpu = _cpu()
    source = b"".join((CSRC / f).read_bytes() for f in ("tiled_gemm.cpp", "amx_gemm.h", "transpose16.h"))
    kernel = hashlib.sha256(source).hexdigest()[:12]  # its timings go stale with it
    text = json.dumps([CACHE_VERSION, cpu["model"], cpu["flags"], torch.__version__, torch.get_num_threads(),
                       str(dtype), [(r.role, r.shapes, r.count) for r in roles], paths, kernel, wait_policy(),
                       native_march(), os.environ.get("KVSERVE_TILED_AMX", "")])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path(roles: tuple[RoleShape, ...], dtype: torch.dtype) -> Path:
    return cache_dir() / "gemm" / f"{_key(roles, dtype, candidate_paths())}.json"


def _read_cache(path: Path) -> dict[str, list[dict[str, float]]] | None:
    try:
        data = json.loads(path.read_text())
        timings = data["timings_us"]
        if set(timings) == set(ROLES) and all(len(b) == len(BANDS) for b in timings.values()):
            return timings  # type: ignore[no-any-return]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_cache(path: Path, timings: dict[str, list[dict[str, float]]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"cpu": _cpu(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                                   "timings_us": timings}, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("cannot cache GEMM timings in %s: %s", path, e)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def plan_for(roles: tuple[RoleShape, ...], dtype: torch.dtype, forced: str | None = None,
             timer: Timer | None = None) -> GemmPlan:
    """The plan for a model with these roles in ``dtype`` on this machine (see the module doc);
    recorded in :mod:`kvserve.native.choices` and logged."""
    plan = _plan(roles, dtype, forced or os.environ.get("KVSERVE_GEMM") or None, timer)
    record_plan(plan)
    return plan


def _plan(roles: tuple[RoleShape, ...], dtype: torch.dtype, forced: str | None, timer: Timer | None) -> GemmPlan:
    if forced not in (None, "auto"):
        paths = candidate_paths()
        if forced != "fbgemm_fp16" and forced not in paths:
            raise ValueError(f"KVSERVE_GEMM={forced}: not a GEMM path here (choose from auto, fbgemm_fp16, "
                             f"{', '.join(paths)})")
        return uniform(forced, "forced")  # type: ignore[arg-type]
    # untimed models never build the tiled kernel (candidate_paths() would, ~60 s on a cold cache)
    if dtype == torch.float32 or sum(r.elements * r.count for r in roles) < TUNE_MIN_ELEMENTS:
        return uniform(default_path(dtype), "default")
    paths = candidate_paths()
    if len(paths) == 1:
        return uniform(paths[0], "default")
    budget = extra_budget()
    role_bytes = {r.role: r.elements * r.count * dtype.itemsize for r in roles}
    counts = {r.role: r.count for r in roles}
    path = cache_path(roles, dtype)
    cached = None if _env_true("KVSERVE_RETUNE_KERNELS") or timer is not None else _read_cache(path)
    if cached is not None:
        return decide(cached, role_bytes, budget, "cached", counts)
    first = default_path(dtype)  # the likely winner first, so the others can stop after one pass
    order = tuple(sorted(paths, key=lambda p: p != first and not p.startswith(first)))
    timings = _confirmed(measure(roles, order, dtype, timer), roles, order, dtype, timer,
                         lambda t: decide(t, role_bytes, budget, "measured", counts))
    if timer is None:
        _write_cache(path, timings)
    return decide(timings, role_bytes, budget, "measured", counts)


CONFIRM_ROUNDS = 1
"""Times a role is measured again when its plan takes decode off the loaded tensor (below)."""


def _costs_decode(plan: GemmPlan, timings: dict[str, list[dict[str, float]]]) -> list[str]:
    """Roles whose plan runs the one-row band (every decode step) off the loaded tensor although a
    path on it was that band's fastest: another band's slowdown decided it."""
    return [role for role, bands in timings.items()
            if storage_of(min(bands[0], key=bands[0].__getitem__)) == "loaded"
            and storage_of(plan.paths[role][0]) != "loaded"]


def _confirmed(timings: dict[str, list[dict[str, float]]], roles: tuple[RoleShape, ...], paths: tuple[str, ...],
               dtype: torch.dtype, timer: Timer | None,
               plan_of: Callable[[dict[str, list[dict[str, float]]]], GemmPlan]) -> dict[str, list[dict[str, float]]]:
    """``timings`` with the roles whose plan :func:`_costs_decode` measured again (up to
    :data:`CONFIRM_ROUNDS` times), each entry the least of its timings (noise only slows a path
    down). Session 23, Zen 4: one start-up measurement timed the tiled MLP at 16 rows 1.47x oneDNN's
    copy (2,355 against 1,603 µs; 1,460 against 1,616 a few minutes later), which put the MLP on
    oneDNN's copy in every band and decode off the native layer loop: 1.40x llama.cpp's time per
    token against 0.96x with the MLP on the tiled kernel (``benchmarks/decode_pair.py``)."""
    for _ in range(CONFIRM_ROUNDS):
        contested = _costs_decode(plan_of(timings), timings)
        if not contested:
            break
        log.info("GEMM plan: measuring %s again (its plan takes one-row steps off the loaded tensor)",
                 ", ".join(contested))
        again = measure(tuple(r for r in roles if r.role in contested), paths, dtype, timer)
        for role, bands in again.items():
            timings[role] = [{p: min(t, old.get(p, t)) for p, t in new.items()} for old, new in zip(timings[role], bands)]
    return timings


def extra_budget() -> int:
    """Bytes of second weight copies a plan may keep: ``KVSERVE_GEMM_EXTRA_MIB`` (MiB, >= 0; set by
    ``--gemm-extra-memory`` on serve and generate), default :data:`EXTRA_BYTES_DEFAULT`."""
    text = os.environ.get("KVSERVE_GEMM_EXTRA_MIB", "").strip()
    if not text:
        return EXTRA_BYTES_DEFAULT
    try:
        mib = float(text)
    except ValueError:
        mib = -1.0
    if not mib >= 0:  # also NaN
        raise ValueError(f"KVSERVE_GEMM_EXTRA_MIB must be a number of MiB >= 0, got {text!r}")
    return int(mib * 2**20)


def set_extra_budget(size: str) -> None:
    """``--gemm-extra-memory SIZE`` ("1GiB", "600MiB", a byte count, or 0): the budget of
    :func:`extra_budget`, for the loader here or in a runner process (through the environment)."""
    n = 0 if size.strip() == "0" else parse_size(size)
    os.environ["KVSERVE_GEMM_EXTRA_MIB"] = repr(n / 2**20)


def record_plan(plan: GemmPlan) -> None:
    """Record and log every (role, band) choice of ``plan``."""
    for role, bands in plan.paths.items():
        for b, (band, path) in enumerate(zip(BANDS, bands)):
            timings = plan.timings_us.get(role, [{}] * len(BANDS))[b]
            record(KernelChoice(f"gemm_{role}", band, path, dict(timings), plan.source))
    summary = "; ".join(f"{r} " + "/".join(bands) for r, bands in plan.paths.items())
    log.info("GEMM paths (%s, bands %s): %s", plan.source, "/".join(BANDS), summary)
