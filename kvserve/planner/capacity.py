"""The memory ledger and what the KV budget buys.

    KV budget (per GPU) = usable memory × utilization − weights / tp − reserve

or a fixed ``--kv-cache-memory``, as the engine takes it. The pool is then sized by the engine's
own :func:`kvserve.kv.layout.capacity_for_budget`, so ``num_blocks`` and ``token_capacity`` equal the
engine's allocation for the same budget. Concurrency and context limits count whole blocks per
sequence (a sequence of T tokens holds ⌈T / block_size⌉ blocks), windowed layers capped at their
window.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.layout import KVCapacity, capacity_for_budget
from kvserve.planner.hardware import HardwareSpec
from kvserve.planner.inputs import Settings
from kvserve.planner.kv_model import KVModel
from kvserve.planner.units import fmt_bytes

CONTEXTS: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768, 131072)
_MAX_SEARCH_TOKENS = 2**40


class DoesNotFit(ValueError):
    """The model leaves no room for KV (weights and reserve exceed memory, or less than one block)."""


@dataclass(frozen=True)
class Ledger:
    """Where one GPU's memory goes. ``engine_bytes`` = usable × utilization (None without hardware)."""

    usable_bytes: int | None
    utilization: float
    engine_bytes: int | None
    weights_bytes: int
    weights_per_gpu: int
    reserve_bytes: int
    kv_budget_bytes: int
    fixed_budget: bool

    @property
    def unplanned_bytes(self) -> int | None:
        """What a fixed budget leaves (negative: over-committed) of usable × utilization."""
        if self.engine_bytes is None:
            return None
        return self.engine_bytes - self.weights_per_gpu - self.reserve_bytes - self.kv_budget_bytes


def build_ledger(s: Settings, hw: HardwareSpec | None, weights_bytes: int, model_name: str) -> Ledger:
    """The ledger; raises ``ValueError`` when weights and reserve leave nothing for KV, saying by how much."""
    per_gpu = -(-weights_bytes // s.tp)
    engine = int(hw.memory_bytes * s.utilization) if hw is not None else None
    if engine is not None and s.reserve_bytes is not None:
        reserve = s.reserve_bytes
    elif engine is not None:
        reserve = int(engine * (s.reserve_fraction or 0.0))
    else:
        reserve = 0
    if s.kv_cache_memory is not None:
        return Ledger(
            hw.memory_bytes if hw else None,
            s.utilization,
            engine,
            weights_bytes,
            per_gpu,
            reserve,
            s.kv_cache_memory,
            True,
        )
    if hw is None or engine is None:
        raise ValueError("give --hardware (a preset or cpu), --memory, or a fixed --kv-cache-memory")
    budget = engine - per_gpu - reserve
    if budget <= 0:
        raise DoesNotFit(
            f"{model_name} cannot fit on {hw.name}: weights {fmt_bytes(per_gpu)} "
            f"+ reserve {fmt_bytes(reserve)} "
            f"exceed usable × utilization {fmt_bytes(engine)} by {fmt_bytes(-budget)}; "
            "try a larger --tp, a smaller --dtype, a lower --reserve or a bigger card"
        )
    return Ledger(hw.memory_bytes, s.utilization, engine, weights_bytes, per_gpu, reserve, budget, False)


def pool(ledger: Ledger, kv: KVModel, s: Settings, window: tuple[int, int] = (0, 0)) -> KVCapacity:
    """The engine's block pool for this budget (the same call the engine makes); ``window`` is the
    full-precision window (blocks, bytes each) a lossy KV codec sets aside first."""
    try:
        return capacity_for_budget(ledger.kv_budget_bytes, kv.bytes_per_token, s.block_size, s.max_model_len,
                                   *window, sliding_window=kv.uniform_window)
    except ValueError as exc:
        block = kv.bytes_per_token * s.block_size
        if window[0] and ledger.kv_budget_bytes >= block:
            raise DoesNotFit(str(exc)) from None  # the full-precision window takes the budget
        raise DoesNotFit(
            f"the KV budget {fmt_bytes(ledger.kv_budget_bytes)} is smaller than one block "
            f"({block:,} B = {s.block_size} tokens × {kv.bytes_per_token:,} B) by "
            f"{fmt_bytes(block - ledger.kv_budget_bytes)}; nothing fits"
        ) from None


def max_sequences(budget: int, kv: KVModel, tokens: int, block_size: int) -> int:
    """Whole sequences of ``tokens`` tokens the budget holds at once."""
    return budget // kv.sequence_block_bytes(tokens, block_size)


def max_context(budget: int, kv: KVModel, concurrency: int, block_size: int) -> int | None:
    """Longest context each of ``concurrency`` sequences can reach together; ``None`` when every layer
    is windowed and the windows fit (the context is then not bounded by memory)."""

    def fits(t: int) -> bool:
        return concurrency * kv.sequence_block_bytes(t, block_size) <= budget

    if fits(_MAX_SEARCH_TOKENS):
        return None
    lo, hi = 0, _MAX_SEARCH_TOKENS  # fits(lo) holds (zero tokens), fits(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class FitCheck:
    """Does ``max_num_seqs`` × ``max_model_len`` fit the budget? ``shortfall_bytes`` is 0 when it does."""

    max_num_seqs: int
    max_model_len: int
    sequence_bytes: int
    needed_bytes: int
    budget_bytes: int
    full_length_sequences: int
    max_len_at_max_num_seqs: int | None

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.budget_bytes

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.needed_bytes - self.budget_bytes)


def fit_check(budget: int, kv: KVModel, s: Settings) -> FitCheck:
    seq = kv.sequence_block_bytes(s.max_model_len, s.block_size)
    return FitCheck(
        s.max_num_seqs,
        s.max_model_len,
        seq,
        s.max_num_seqs * seq,
        budget,
        budget // seq,
        max_context(budget, kv, s.max_num_seqs, s.block_size),
    )
