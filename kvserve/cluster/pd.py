"""Blocks between replicas, front-end side: the prefill/decode split (a prompt's KV is computed on
a prefill replica and its blocks sent to the decode replica, which then serves the whole request)
and a session moving off a busy replica (its history's blocks go with it).

Both use one transfer (:func:`move_blocks`), through the block ``SendBlocks`` / ``ReceiveBlocks``
operations (:mod:`kvserve.engine.kv_transfer`) over one of two channels:

* ``direct``: the sender's runner writes the blocks over TCP to the receiver's runner;
* ``object_store``: the sender's runner leaves them in its outbox, the send call returns them as
  a Ray object, and the front end hands that reference to the receiver, so the bytes go replica
  to replica through Ray's object store (never through the front end).

Invariants:
  * the receiver decides what it wants: the hashes after its own leading pool hits;
  * a transfer that fails or takes longer than ``timeout_s`` (1 s) is abandoned and the receiver
    computes those blocks itself; nobody waits longer than that for a transfer;
  * received blocks become findable only after their checks passed, so a request served from
    them gets the tokens one engine gives;
  * the ledger counts every transfer: blocks and bytes moved, seconds spent, fallbacks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvserve.engine.async_engine import EngineDeadError
from kvserve.kv.hashing import hash_full_blocks, request_root
from kvserve.sampling_params import SamplingParams

CHANNELS = ("direct", "object_store")


@dataclass
class TransferLedger:
    transfers: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    fallbacks: int = 0   # failed or slow: the receiver computed the blocks
    skipped: int = 0     # the receiver already held the whole prefix
    sessions_moved: int = 0


def _open(rs: Any, dst: str, hashes: list[bytes]) -> tuple[str, str, Any] | None:
    """Start a transfer into ``dst``: (its name, the peer string, the pending ``begin_receive``),
    or None when ``dst`` has no direct channel and the channel is direct."""
    t = uuid.uuid4().hex
    if rs.pd_channel == "direct":
        if not rs.peer_addresses.get(dst):  # its runner is not inline: no channel to it
            return None
        peer = f"{rs.peer_addresses[dst]}/{t}"
    else:
        peer = f"ray:{t}"
    # not under the timeout: an abandoned begin would hold blocks until they expire
    return t, peer, asyncio.ensure_future(rs.replicas[dst].handle.begin_receive.remote(t, hashes, peer))


async def move_blocks(rs: Any, src: str, dst: str, hashes: list[bytes], timeout_s: float,
                      opened: tuple[str, str, Any] | None = None) -> int:
    """Move the blocks of ``hashes`` that ``dst`` lacks from ``src`` to ``dst``; returns the
    blocks ``dst`` can now find (0 on a fallback, counted). Never raises for a replica.
    ``opened``: a transfer :func:`_open` started earlier (beside the prefill)."""
    ledger: TransferLedger = rs.transfers
    opened = opened or _open(rs, dst, hashes)
    if opened is None:
        ledger.fallbacks += 1
        return 0
    t, peer, begun = opened
    sender, receiver = rs.replicas[src].handle, rs.replicas[dst].handle
    try:
        wanted = await begun
    except Exception:  # noqa: BLE001 - a dead replica, or one whose runner has no peer hub
        ledger.fallbacks += 1
        return 0
    if not wanted:
        ledger.skipped += 1
        return 0
    t0 = time.monotonic()
    try:
        frames, stats = sender.send_blocks.options(num_returns=2).remote(t, wanted, peer, timeout_s)
        if rs.pd_channel == "direct":
            _, nbytes = await asyncio.wait_for(stats, timeout_s)
            got = await asyncio.wait_for(receiver.finish_receive.remote(t, None), timeout_s)
        else:  # the frames' reference goes straight to the receiver: Ray moves the bytes
            got, (_, nbytes) = await asyncio.wait_for(
                asyncio.gather(receiver.finish_receive.remote(t, frames), stats), timeout_s)
    except Exception:  # noqa: BLE001 - timeout, a dead replica, a refused or cut-off channel
        receiver.abandon_receive.remote(t)
        ledger.fallbacks += 1
        return 0
    finally:
        ledger.seconds += time.monotonic() - t0
    ledger.transfers += 1
    ledger.blocks += got
    ledger.bytes += nbytes
    return int(got)


async def ship_prefix(rs: Any, prompt: Any, hashes: tuple[bytes, ...], decode: str, cache_salt: str | None,
                      kv_cache_dtype: str | None, timeout_s: float = 1.0) -> None:
    """Prefill ``prompt`` on a prefill replica and move the blocks ``decode`` lacks to it (the
    decode replica sets its blocks aside while the prefill runs)."""
    if len(rs.index.prefix(decode, hashes)) == len(hashes):
        rs.transfers.skipped += 1
        return
    opened = _open(rs, decode, list(hashes))
    try:
        prefill = await rs.route_among(rs.prefill, hashes)
        stream = await rs.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), cache_salt=cache_salt,
                                      kv_cache_dtype=kv_cache_dtype, replica=prefill)
        await stream.result()
    except EngineDeadError:  # no prefill replica, or it died: the decode replica computes
        if opened is not None:
            rs.replicas[decode].handle.abandon_receive.remote(opened[0])
        rs.transfers.fallbacks += 1
        return
    await move_blocks(rs, prefill, decode, list(hashes), timeout_s, opened)


async def move_session(rs: Any, session_id: str, src: str, dst: str, timeout_s: float) -> bool:
    """Make ``dst`` serve ``session_id`` instead of ``src`` (busy): its record, then its history's
    blocks, then ``src`` forgets it. False (nothing changed) if a turn of it runs on ``src``, or
    either replica fails; a failed block transfer only means ``dst`` recomputes the history."""
    try:
        record = await rs.replicas[src].handle.move_out.remote(session_id)
        if record is None:
            return False
        root = request_root(rs.info.root_key, None, record.get("cache_salt"))
        await move_blocks(rs, src, dst, hash_full_blocks(record["token_ids"], rs.info.block_size, root), timeout_s)
        if not await rs.replicas[dst].handle.move_in.remote(record):
            return False
        await rs.replicas[src].handle.forget_moved.remote(session_id)
    except rs._errors:
        return False
    rs.transfers.sessions_moved += 1
    return True
