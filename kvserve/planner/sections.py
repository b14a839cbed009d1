"""The tables the text and markdown views print, built from :func:`plan_to_dict` (both units,
GiB and GB = 10^9 bytes, side by side)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.planner.plan import Plan
from kvserve.planner.report import plan_to_dict
from kvserve.planner.units import GB, GIB, fmt_bytes, fmt_seconds, fmt_tokens


@dataclass(frozen=True)
class Section:
    title: str
    columns: tuple[str, ...]
    rows: list[list[str]]
    caption: str | None = None


def _gib_gb(n: float) -> list[str]:
    return [f"{n / GIB:,.2f}", f"{n / GB:,.2f}"]


def sections(plan: Plan) -> list[Section]:
    """The tables the text and markdown views print, in reading order."""
    d = plan_to_dict(plan)
    spec, s, led = plan.spec, plan.settings, plan.ledger
    per_gpu = " per GPU" if s.tp > 1 else ""
    p = plan.params
    model_rows = [
        ["model", f"{spec.name} ({spec.source})"],
        [
            "attention",
            (
                f"{spec.attention_kind}: {spec.num_layers} layers, {spec.num_attention_heads} heads, "
                f"{spec.num_kv_heads} KV heads, head_dim {spec.head_dim}"
            ),
        ],
        ["parameters", f"{p.total:,}" + (f" ({p.active:,} active per token)" if p.active != p.total else "")],
        [
            "weights",
            f"{fmt_bytes(led.weights_bytes)} "
            + ("(--weights-memory)" if s.weights_memory else f"at {s.weight_dtype}")
            + (f"; {fmt_bytes(led.weights_per_gpu)} per GPU (tp {s.tp})" if s.tp > 1 else ""),
        ],
        ["KV bytes/token" + per_gpu, plan.kv.formula],
    ]
    out = [Section("Model and KV cost", ("", ""), model_rows)]
    hw_name = plan.hardware.name if plan.hardware else "none given"
    ledger_rows = []
    if led.usable_bytes is not None:
        ledger_rows.append(
            [
                "usable memory",
                fmt_bytes(led.usable_bytes),
                plan.hardware.memory_source if plan.hardware else "",
            ]
        )
        ledger_rows.append([f"× utilization {led.utilization:g}", fmt_bytes(led.engine_bytes or 0), ""])
        ledger_rows.append(
            [
                "− weights",
                fmt_bytes(led.weights_per_gpu),
                "--weights-memory" if s.weights_memory else s.weight_dtype,
            ]
        )
        ledger_rows.append(["− reserve", fmt_bytes(led.reserve_bytes), _reserve_text(plan)])
    ledger_rows.append(
        [
            "= KV budget",
            fmt_bytes(led.kv_budget_bytes),
            "fixed by --kv-cache-memory" if led.fixed_budget else "",
        ]
    )
    cap = plan.capacity
    ledger_rows.append(
        [
            "KV pool",
            f"{cap.num_blocks:,} blocks × {cap.block_size} = {cap.token_capacity:,} tokens",
            f"{fmt_bytes(cap.allocated_bytes)} allocated",
        ]
    )
    out.append(
        Section(
            f"Memory ledger{per_gpu} ({hw_name})",
            ("", "bytes", "note"),
            ledger_rows,
            f"the engine, given this budget, logs: {d['engine_log_line']}",
        )
    )
    seq_rows = []
    for r in d["kv_per_sequence"]:
        seq_rows.append(
            [
                fmt_tokens(r["tokens"]),
                *_gib_gb(r["bytes"]),
                *_gib_gb(r["batch_bytes"]),
                f"{r['max_sequences']:,}",
            ]
        )
    out.append(
        Section(
            "KV per sequence and concurrency",
            ("context", "KV GiB", "KV GB", f"×{s.concurrency} GiB", f"×{s.concurrency} GB", "max sequences"),
            seq_rows,
            f"{s.kv_dtype} KV, block {s.block_size}; max sequences = whole blocks in the KV budget"
            + (f"; sizes are for all {s.tp} GPUs together" if s.tp > 1 else ""),
        )
    )
    out.append(Section("Does it fit?", ("", ""), _fit_rows(plan, d)))
    if d["decode"] and d["decode"]["rows"]:
        rows = [
            [
                str(r["batch"]),
                fmt_bytes(r["weights_read_bytes"] + r["kv_read_bytes"]),
                fmt_seconds(r["time_per_token_s"]),
                f"{r['tokens_per_s']:,.1f}",
                ""
                if r["usd_per_million_output_tokens"] is None
                else f"${r['usd_per_million_output_tokens']:,.3f}",
            ]
            for r in d["decode"]["rows"]
        ]
        out.append(
            Section(
                f"Decode lower bound at {d['decode']['context']:,} tokens per sequence",
                ("batch", f"bytes read/step{per_gpu}", "time/token ≥", "tokens/s ≤", "$/M tokens ≥"),
                rows,
                "(weights + batch × KV) ÷ bandwidth"
                + ("" if s.price_per_hour else "; cost needs --price-per-hour"),
            )
        )
    out.append(Section("A typical request", ("", ""), _request_rows(d["request"])))
    out.append(
        Section(
            "Settings",
            ("setting", "value", "from"),
            [
                [k, str(v["value"]), v["source"] + (f": {v['reason']}" if v["reason"] else "")]
                for k, v in d["settings"].items()
            ],
        )
    )
    if plan.kernels:
        out.append(Section("Kernels on this CPU (GEMM path per row band)", ("role", "band", "choice", "source"),
                           [list(k) for k in plan.kernels]))
    if plan.notes:
        out.append(Section("Notes", ("",), [[n] for n in plan.notes]))
    return out


def _reserve_text(plan: Plan) -> str:
    s = plan.settings
    if s.reserve_bytes is not None:
        return "fixed"
    return f"{(s.reserve_fraction or 0) * 100:g}% of usable × utilization"


def _fit_rows(plan: Plan, d: dict[str, Any]) -> list[list[str]]:
    f = d["fit"]
    verdict = "fits" if f["fits"] else f"does NOT fit: short by {fmt_bytes(f['shortfall_bytes'])}"
    rows = [
        [
            f"max_num_seqs {f['max_num_seqs']} × max_model_len {f['max_model_len']:,}",
            f"needs {fmt_bytes(f['needed_bytes'])} of {fmt_bytes(f['budget_bytes'])}: {verdict}",
        ],
        [
            "full-length sequences that fit",
            (f"{f['full_length_sequences']:,} ({f['budget_bytes'] / f['sequence_bytes']:.2f} as a fraction)"),
        ],
    ]
    m = f["max_model_len_at_max_num_seqs"]
    rows.append(
        [
            f"longest context for {f['max_num_seqs']} sequences",
            "not bounded (every layer windowed)" if m is None else f"{m:,} tokens",
        ]
    )
    mc = d["max_context_at_concurrency"]
    if mc["concurrency"] != f["max_num_seqs"]:
        t = mc["tokens"]
        rows.append(
            [
                f"longest context for {mc['concurrency']} sequences",
                "not bounded (every layer windowed)" if t is None else f"{t:,} tokens",
            ]
        )
    return rows


def _request_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = [
        [
            "shape",
            f"{r['prompt_tokens']:,} prompt + {r['output_tokens']:,} output tokens, batch {r['batch']}",
        ],
        ["KV at its last token", fmt_bytes(r["kv_bytes_at_end"])],
    ]
    if r["prefill_flops"] is not None:
        t = r["prefill_time_s"]
        rows.append(
            [
                "prefill",
                f"{r['prefill_flops'] / 1e12:,.2f} TFLOP"
                + ("" if t is None else f", ≥ {fmt_seconds(t)} at peak dense throughput"),
            ]
        )
    if r["gib_seconds"] is not None:
        rows.append(["KV memory × time", f"{r['gib_seconds']:,.3f} GiB·s"])
    if r["kv_rent_usd"] is not None:
        rows.append(["KV rent (share of the pool's price)", f"${r['kv_rent_usd']:.6f} per request"])
    priced = r.get("price")
    if priced is not None:
        c = priced["cost_usd"]
        text = (f"${c['total']:.6f}: input ${c['input']:.6f}, cached {priced['cached_tokens']:,} tokens "
                f"${c['cached_input']:.6f}, output ${c['output']:.6f}; the cache saves ${c['saved_by_cache']:.6f}")
        rows.append(["price per request", text])
        if priced["break_even_requests_per_gpu_hour"] is not None:
            rows.append(["break-even", f"{priced['break_even_requests_per_gpu_hour']:,.0f} such requests per GPU-hour"])
    return rows
