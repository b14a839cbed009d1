"""``build_plan``: from a :class:`PlanRequest` to every figure the reports print.

The pieces are computed by their own modules (ledger and pool in ``capacity``, bytes per token in
``kv_model``, speed and cost in ``performance``); this file only wires them together and collects
the notes a reader should see.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.layout import KVCapacity
from kvserve.planner import performance
from kvserve.planner.capacity import (
    CONTEXTS,
    FitCheck,
    Ledger,
    build_ledger,
    fit_check,
    max_context,
    max_sequences,
    pool,
)
from kvserve.planner.hardware import HardwareSpec, resolve_hardware
from kvserve.planner.inputs import PlanRequest, Settings, resolve_settings
from kvserve.planner.kernels import cpu_kernel_rows
from kvserve.planner.kv_model import KVModel, build_kv_model, fp_window_block_bytes
from kvserve.planner.loader import load_model
from kvserve.planner.model_spec import ModelSpec
from kvserve.planner.params import ParamCount, count_parameters, weights_bytes
from kvserve.planner.units import fmt_bytes, parse_bandwidth, parse_memory, parse_positive_float


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    spec: ModelSpec
    settings: Settings
    hardware: HardwareSpec | None
    params: ParamCount
    kv: KVModel
    ledger: Ledger
    capacity: KVCapacity
    fit: FitCheck
    perf: performance.Perf | None
    notes: tuple[str, ...]
    kernels: tuple[tuple[str, str, str, str], ...] = ()  # (role, band, choice, source) with --hardware cpu

    @property
    def contexts(self) -> list[int]:
        return sorted(set(CONTEXTS) | {self.settings.max_model_len})

    @property
    def request_context(self) -> int:
        """Tokens a typical request holds at its last step (prompt + output)."""
        return self.settings.prompt_tokens + self.settings.output_tokens

    def max_sequences(self, tokens: int) -> int:
        return max_sequences(self.ledger.kv_budget_bytes, self.kv, tokens, self.settings.block_size)

    def max_context(self, concurrency: int) -> int | None:
        return max_context(self.ledger.kv_budget_bytes, self.kv, concurrency, self.settings.block_size)

    def decode_batch(self) -> int:
        """The batch the cost figures use: the concurrency asked for, or as many typical requests as fit."""
        return max(1, min(self.settings.concurrency, self.max_sequences(self.request_context)))


def _notes(spec: ModelSpec, s: Settings, hw: HardwareSpec | None, ledger: Ledger, fit: FitCheck) -> list[str]:
    notes: list[str] = []
    if spec.engine_config is None:
        notes.append(f"{spec.architecture} is planned from its shape; the kvserve engine does not run it yet")
    if s.max_model_len > spec.max_position_embeddings:
        notes.append(
            f"max_model_len {s.max_model_len:,} exceeds the model's {spec.max_position_embeddings:,} "
            "trained positions"
        )
    if spec.windowed_layers and s.sliding_window is None:
        notes.append(
            f"{spec.windowed_layers} of {spec.num_layers} layers use a sliding window: per-sequence "
            "figures cap them at the blocks the window spans (kvserve frees the blocks behind it)"
        )
    if s.sliding_window is not None:
        notes.append(
            f"KV window {s.sliding_window:,} tokens applied to every layer: older tokens are assumed "
            "evicted (lossy unless the model was trained with that window; the pool size does not change)"
        )
    ub = ledger.unplanned_bytes
    if ledger.fixed_budget and ub is not None and ub < 0:
        notes.append(f"--kv-cache-memory over-commits usable × utilization by {fmt_bytes(-ub)}")
    if fit.full_length_sequences == 0:
        notes.append(f"not even one sequence of max_model_len {s.max_model_len:,} fits the KV budget")
    if hw is not None:
        notes.extend(hw.notes[:1])
    return notes


def build_plan(req: PlanRequest) -> Plan:
    """Compute a plan; every user error is a one-line ``ValueError``/``FileNotFoundError``."""
    spec = load_model(req.model)
    s = resolve_settings(req, spec)
    hw = resolve_hardware(
        req.hardware,
        parse_memory("--memory", req.memory) if req.memory else None,
        parse_bandwidth("--bandwidth", req.bandwidth) if req.bandwidth else None,
        parse_positive_float("--tflops", req.tflops) if req.tflops else None,
    )
    params = count_parameters(spec)
    weights = (
        s.weights_memory if s.weights_memory is not None else weights_bytes(params.total, s.weight_dtype)
    )
    kv = build_kv_model(spec, s.kv_dtype, s.tp, s.sliding_window, s.block_size)
    ledger = build_ledger(s, hw, weights, spec.name)
    kv_pool = pool(ledger, kv, s, fp_window_block_bytes(spec, s, kv))
    fit = fit_check(ledger.kv_budget_bytes, kv, s)
    perf = None
    if hw is not None:
        perf = performance.Perf(spec, params, kv, hw, s.weight_dtype, weights / params.total, s.tp)
    kernels = cpu_kernel_rows(spec, s.weight_dtype, s.block_size) if hw is not None and hw.key == "cpu" else ()
    return Plan(
        req, spec, s, hw, params, kv, ledger, kv_pool, fit, perf, tuple(_notes(spec, s, hw, ledger, fit)), kernels
    )
