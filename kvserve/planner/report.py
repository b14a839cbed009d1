"""A plan as data: the JSON document ``--json`` prints, with exact integers for bytes, blocks and
tokens. Per-sequence and fit figures are for all GPUs together (per-GPU × tp); the ledger, the pool
(``num_blocks``, ``token_capacity``, ``bytes_per_token``) and decode bytes are per GPU, as each
GPU's engine allocates them."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvserve.planner.performance import cost_per_million_tokens, decode_batches
from kvserve.planner.plan import Plan
from kvserve.planner.units import GIB


def _decode_rows(plan: Plan) -> list[dict[str, Any]]:
    if plan.perf is None or plan.hardware is None or plan.hardware.bandwidth_bytes_s is None:
        return []
    ctx = plan.request_context
    out = []
    for b in decode_batches(max(1, plan.max_sequences(ctx)), plan.settings.concurrency):
        row = plan.perf.decode(b, ctx)
        assert row is not None
        price = plan.settings.price_per_hour
        out.append(
            {
                "batch": b,
                "weights_read_bytes": int(row.weights_read_bytes),
                "kv_read_bytes": row.kv_read_bytes,
                "time_per_token_s": row.time_per_token_s,
                "tokens_per_s": row.tokens_per_s,
                "usd_per_million_output_tokens": cost_per_million_tokens(
                    price, plan.settings.tp, row.tokens_per_s
                )
                if price
                else None,
            }
        )
    return out


def _request(plan: Plan) -> dict[str, Any]:
    s = plan.settings
    batch = plan.decode_batch()
    out: dict[str, Any] = {
        "prompt_tokens": s.prompt_tokens,
        "output_tokens": s.output_tokens,
        "batch": batch,
        "kv_bytes_at_end": plan.kv.sequence_bytes(plan.request_context) * s.tp,
        "prefill_flops": None,
        "prefill_time_s": None,
        "gib_seconds": None,
        "kv_rent_usd": None,
        "price": _priced(plan),
    }
    if plan.perf is None:
        return out
    out["prefill_flops"] = plan.perf.prefill_flops(s.prompt_tokens)
    out["prefill_time_s"] = plan.perf.prefill_time(s.prompt_tokens)
    gib_s = plan.perf.request_gib_seconds(s.prompt_tokens, s.output_tokens, batch)
    out["gib_seconds"] = gib_s
    if gib_s is not None and s.price_per_hour:
        pool_gib = plan.ledger.kv_budget_bytes * s.tp / GIB
        out["kv_rent_usd"] = s.price_per_hour * s.tp / 3600.0 * gib_s / pool_gib
    return out


def _priced(plan: Plan) -> dict[str, Any] | None:
    """A typical request's cost at the token prices (the server's ``usage.cost``, same code), and
    with a GPU-hour price, how many such requests per GPU-hour pay for the machine."""
    s = plan.settings
    if s.prices is None:
        return None
    cached = int(s.prompt_tokens * s.cached_fraction) // s.block_size * s.block_size  # whole blocks
    cost = s.prices.cost(s.prompt_tokens, cached, s.output_tokens)
    out: dict[str, Any] = {"cached_tokens": cached, "cost_usd": cost, "break_even_requests_per_gpu_hour": None}
    if s.price_per_hour and cost["total"] > 0:
        out["break_even_requests_per_gpu_hour"] = s.price_per_hour * s.tp / cost["total"]
    return out


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """Everything the plan computed, with exact integers for bytes, blocks and tokens."""
    spec, s, led, cap, fit = plan.spec, plan.settings, plan.ledger, plan.capacity, plan.fit
    hw = plan.hardware
    c = s.concurrency
    return {
        "model": {
            "name": spec.name,
            "source": spec.source,
            "architecture": spec.architecture,
            "attention": spec.attention_kind,
            "layers": spec.num_layers,
            "attention_heads": spec.num_attention_heads,
            "kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "mla": asdict(spec.mla) if spec.mla else None,
            "max_position_embeddings": spec.max_position_embeddings,
            "parameters": {
                "total": plan.params.total,
                "active": plan.params.active,
                "embedding": plan.params.embedding,
            },
            "engine_supported": spec.engine_config is not None,
        },
        "hardware": None
        if hw is None
        else {
            "name": hw.name,
            "preset": hw.key,
            "memory_bytes": hw.memory_bytes,
            "memory_source": hw.memory_source,
            "bandwidth_bytes_s": hw.bandwidth_bytes_s,
            "dense_tflops": hw.tflops,
        },
        "settings": {
            k: {"value": v, "source": s.sources.get(k, "default"), "reason": s.reasons.get(k)}
            for k, v in _settings_values(plan).items()
        },
        "kv_dtype": s.kv_dtype,
        "block_size": s.block_size,
        "max_model_len": s.max_model_len,
        "bytes_per_token": plan.kv.bytes_per_token,
        "kv_formula": plan.kv.formula,
        "kv_heads_per_gpu": plan.kv.kv_heads_per_gpu,
        "layer_groups": [asdict(g) for g in plan.kv.groups],
        "weights_bytes": led.weights_bytes,
        "weights_bytes_per_gpu": led.weights_per_gpu,
        "ledger": {
            "usable_bytes": led.usable_bytes,
            "utilization": led.utilization,
            "usable_x_utilization_bytes": led.engine_bytes,
            "weights_bytes_per_gpu": led.weights_per_gpu,
            "reserve_bytes": led.reserve_bytes,
            "kv_budget_bytes": led.kv_budget_bytes,
            "fixed_budget": led.fixed_budget,
            "unplanned_bytes": led.unplanned_bytes,
        },
        "num_blocks": cap.num_blocks,
        "token_capacity": cap.token_capacity,
        "allocated_bytes": cap.allocated_bytes,
        "engine_log_line": cap.summary(),
        "max_concurrency_at_max_len": cap.max_concurrency_at_max_len,
        "kv_per_sequence": [
            {
                "tokens": t,
                "bytes": plan.kv.sequence_bytes(t) * s.tp,
                "batch": c,
                "batch_bytes": c * plan.kv.sequence_bytes(t) * s.tp,
                "max_sequences": plan.max_sequences(t),
            }
            for t in plan.contexts
        ],
        "max_context_at_concurrency": {"concurrency": c, "tokens": plan.max_context(c)},
        "fit": {
            "max_num_seqs": fit.max_num_seqs,
            "max_model_len": fit.max_model_len,
            "sequence_bytes": fit.sequence_bytes * s.tp,
            "needed_bytes": fit.needed_bytes * s.tp,
            "budget_bytes": fit.budget_bytes * s.tp,
            "fits": fit.fits,
            "shortfall_bytes": fit.shortfall_bytes * s.tp,
            "full_length_sequences": fit.full_length_sequences,
            "max_model_len_at_max_num_seqs": fit.max_len_at_max_num_seqs,
        },
        "decode": {"context": plan.request_context, "rows": _decode_rows(plan)} if plan.perf else None,
        "request": _request(plan),
        "notes": list(plan.notes),
        "kernels": [dict(zip(("role", "band", "choice", "source"), k)) for k in plan.kernels],
    }


def _settings_values(plan: Plan) -> dict[str, Any]:
    s = plan.settings
    reserve = s.reserve_fraction if s.reserve_bytes is None else s.reserve_bytes
    return {
        "scenario": s.scenario,
        "dtype": s.weight_dtype,
        "kv_dtype": s.kv_dtype,
        "block_size": s.block_size,
        "max_model_len": s.max_model_len,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "concurrency": s.concurrency,
        "utilization": s.utilization,
        "reserve": reserve,
        "tp": s.tp,
        "sliding_window": s.sliding_window,
        "prefix_caching": s.prefix_caching,
        "session_idle_timeout_s": s.session_idle_timeout_s,
        "prompt_tokens": s.prompt_tokens,
        "output_tokens": s.output_tokens,
        "price_per_hour": s.price_per_hour,
    }
