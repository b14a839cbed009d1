"""What-if: ``--compare kv_dtype=bf16,int8,int4`` plans each variant and prints them side by side.

Any input can vary (``hardware=h100,h200``, ``tp=1,2,4``, ``max_model_len=8K,32K``). A variant in
which the model cannot fit shows why in its column; any other bad value is an error for the whole
command, as it would be for a single plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.planner.capacity import DoesNotFit
from kvserve.planner.inputs import PlanRequest
from kvserve.planner.plan import Plan, build_plan
from kvserve.planner.report import plan_to_dict
from kvserve.planner.sections import Section
from kvserve.planner.units import fmt_bytes, fmt_seconds


@dataclass(frozen=True)
class Variant:
    value: str
    plan: Plan | None
    error: str | None


def parse_compare(spec: str) -> tuple[str, list[str]]:
    """``key=a,b,c`` → (key, [a, b, c]); at least two values."""
    if "=" not in spec:
        raise ValueError(f"--compare must look like kv_dtype=bf16,int8,int4, got {spec!r}")
    key, _, raw = spec.partition("=")
    values = [v.strip() for v in raw.split(",") if v.strip()]
    if len(values) < 2:
        raise ValueError(f"--compare {key}: give at least two values separated by commas, got {raw!r}")
    return key.strip(), values


def run_compare(base: PlanRequest, spec: str) -> tuple[str, list[Variant]]:
    key, values = parse_compare(spec)
    out = []
    for v in values:
        req = base.with_value(key, v)
        try:
            out.append(Variant(v, build_plan(req), None))
        except DoesNotFit as exc:
            out.append(Variant(v, None, str(exc)))
    return key, out


def _metrics(plan: Plan) -> dict[str, str]:
    d = plan_to_dict(plan)
    f = d["fit"]
    rows = d["decode"]["rows"] if d["decode"] else []
    first = rows[0] if rows else None
    batch = plan.decode_batch()
    at_batch = next((r for r in rows if r["batch"] == batch), None)
    req = d["request"]
    return {
        "KV dtype": plan.settings.kv_dtype,
        "bytes/token (per GPU)": f"{plan.kv.bytes_per_token:,}",
        "KV budget (per GPU)": fmt_bytes(plan.ledger.kv_budget_bytes),
        "blocks (per GPU)": f"{plan.capacity.num_blocks:,}",
        "token capacity": f"{plan.capacity.token_capacity:,}",
        "sequences at max_model_len": f"{f['full_length_sequences']:,} of {plan.settings.max_model_len:,}",
        "max_num_seqs × max_model_len": "fits" if f["fits"] else f"short {fmt_bytes(f['shortfall_bytes'])}",
        f"longest context × {plan.settings.concurrency}": "unbounded"
        if d["max_context_at_concurrency"]["tokens"] is None
        else f"{d['max_context_at_concurrency']['tokens']:,}",
        "time/token ≥ (batch 1)": fmt_seconds(first["time_per_token_s"]) if first else "",
        "tokens/s ≤ (typical batch)": f"{at_batch['tokens_per_s']:,.0f} @ {batch}" if at_batch else "",
        "$/M tokens ≥": f"${at_batch['usd_per_million_output_tokens']:,.3f}"
        if at_batch and at_batch["usd_per_million_output_tokens"] is not None
        else "",
        "request GiB·s": f"{req['gib_seconds']:,.3f}" if req["gib_seconds"] is not None else "",
    }


def compare_section(key: str, variants: list[Variant]) -> Section:
    """Rows are metrics, columns are the variants."""
    metrics = [(_metrics(v.plan) if v.plan else None) for v in variants]
    names = next((list(m) for m in metrics if m), [])
    rows = []
    for i, name in enumerate(names):
        row = [name]
        for v, m in zip(variants, metrics):
            row.append(m[name] if m else (f"does not fit: {v.error}" if i == 0 else ""))
        rows.append(row)
    return Section(f"Compare {key}", ("", *[f"{key}={v.value}" for v in variants]), rows)


def compare_to_dict(key: str, variants: list[Variant]) -> dict[str, Any]:
    return {
        "compare": key,
        "variants": [
            {"value": v.value, "error": v.error, "plan": plan_to_dict(v.plan) if v.plan else None}
            for v in variants
        ],
    }
