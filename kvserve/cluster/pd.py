"""The prefill/decode split, front-end side: a prompt's KV is computed on a prefill replica and its
blocks shipped to the decode replica, which then serves the whole request (it loads the shipped
blocks instead of computing them, recomputes the rest, and samples every token itself, so the
tokens are the ones a single engine gives).

Invariants:
  * only blocks the decode replica does not already hold (per the router's index) are shipped;
  * a transfer that fails or takes longer than ``timeout_s`` (1 s) is abandoned: the decode
    replica computes the prompt itself; nobody waits longer than that for a transfer (an
    abandoned import may still land later; the blocks are the same, so it changes no token);
  * the ledger counts every transfer: blocks and bytes moved, seconds spent, fallbacks.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from kvserve.engine.async_engine import EngineDeadError
from kvserve.sampling_params import SamplingParams


@dataclass
class TransferLedger:
    transfers: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    fallbacks: int = 0   # failed or slow: the decode replica computed the prompt
    skipped: int = 0     # the decode replica already held the whole prefix


async def ship_prefix(rs: Any, prompt: Any, hashes: tuple[bytes, ...], decode: str, cache_salt: str | None,
                      kv_cache_dtype: str | None, timeout_s: float = 1.0) -> None:
    """Prefill ``prompt`` on a prefill replica and move the blocks ``decode`` lacks to it."""
    ledger: TransferLedger = rs.transfers
    want = list(hashes[len(rs.index.prefix(decode, hashes)):])
    if not want:
        ledger.skipped += 1
        return
    try:
        prefill = await rs.route_among(rs.prefill, hashes)
        stream = await rs.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), cache_salt=cache_salt,
                                      kv_cache_dtype=kv_cache_dtype, replica=prefill)
        await stream.result()
    except EngineDeadError:  # no prefill replica, or it died: the decode replica computes
        ledger.fallbacks += 1
        return
    t0 = time.monotonic()
    try:
        objects = rs.replicas[prefill].handle.export_blocks.remote(want)  # replica → replica, by reference
        blocks, nbytes = await asyncio.wait_for(rs.replicas[decode].handle.import_blocks.remote(objects), timeout_s)
    except (TimeoutError, *rs._errors):
        ledger.fallbacks += 1
        return
    finally:
        ledger.seconds += time.monotonic() - t0
    ledger.transfers += 1
    ledger.blocks += blocks
    ledger.bytes += nbytes
