"""``kvserve plan --model NAME`` with no hardware: what the model alone decides.

Without ``--hardware``, ``--memory`` or ``--kv-cache-memory`` there is no memory ledger, no
concurrency and no speed to compute, but the KV cost is the model's own: bytes per token (with
the formula), KV per sequence length, and KV per batch of sequences. Those are printed instead
of an error, with a line saying what to add for the rest.
"""

from __future__ import annotations

from typing import Any

from kvserve.planner.inputs import PlanRequest, resolve_settings
from kvserve.planner.kv_model import build_kv_model
from kvserve.planner.loader import load_model
from kvserve.planner.sections import Section
from kvserve.planner.units import fmt_bytes, fmt_tokens

LENGTHS = (1024, 4096, 8192, 32768, 131072)
BATCHES = (1, 8, 32, 64, 256)
NO_HARDWARE = ("no hardware given: add --hardware PRESET|cpu, --memory SIZE or --kv-cache-memory SIZE "
               "for the memory ledger, concurrency, speed and cost (see --list)")


def has_hardware(req: PlanRequest) -> bool:
    return any(v is not None for v in (req.hardware, req.memory, req.kv_cache_memory))


def kv_only(req: PlanRequest) -> tuple[list[Section], dict[str, Any]]:
    spec = load_model(req.model)
    s = resolve_settings(req, spec)
    kv = build_kv_model(spec, s.kv_dtype, s.tp, s.sliding_window, s.block_size)
    lengths = sorted({n for n in LENGTHS if n <= s.max_model_len} | {s.max_model_len})
    batches = sorted({b for b in BATCHES if b <= max(s.max_num_seqs, 1)} | {s.max_num_seqs})
    typical = s.prompt_tokens + s.output_tokens
    per_len = {n: kv.sequence_block_bytes(n, s.block_size) for n in lengths}
    batch_lens = sorted({min(typical, s.max_model_len), s.max_model_len})
    per_batch = {(b, n): b * kv.sequence_block_bytes(n, s.block_size) for b in batches for n in batch_lens}
    secs = [
        Section(f"KV per token: {spec.name}", ("", ""), [
            ["KV dtype", s.kv_dtype], ["bytes per token", f"{kv.bytes_per_token:,} B"],
            ["formula", kv.formula],
            ["block size", f"{s.block_size} tokens = {fmt_bytes(kv.bytes_per_token * s.block_size)} a block"],
        ]),
        Section("KV per sequence length (one sequence, whole blocks)", ("tokens", "KV"),
                [[fmt_tokens(n), fmt_bytes(b)] for n, b in per_len.items()]),
        Section("KV per batch (sequences × length)",
                ("sequences", *(f"{fmt_tokens(n)} tokens" for n in batch_lens)),
                [[str(b), *(fmt_bytes(per_batch[(b, n)]) for n in batch_lens)] for b in batches],
                caption=f"{fmt_tokens(typical)} = the typical request (prompt + output); "
                        f"{fmt_tokens(s.max_model_len)} = max_model_len"),
        Section("Not computed", ("",), [[NO_HARDWARE]]),
    ]
    data = {"model": spec.name, "kv_dtype": s.kv_dtype, "bytes_per_token": kv.bytes_per_token,
            "formula": kv.formula, "block_size": s.block_size, "max_model_len": s.max_model_len,
            "kv_bytes_per_sequence": {str(n): b for n, b in per_len.items()},
            "kv_bytes_per_batch": {f"{b}x{n}": v for (b, n), v in per_batch.items()},
            "hardware": None}
    return secs, data
