"""Moving KV blocks and sessions between engines: the engine-thread commands behind a
prefill/decode split and a session moving off a busy replica (run through ``AsyncLLMEngine.call``).

A transfer of blocks, named ``t`` by whoever starts it::

    receiver: begin_receive(t, hashes, peer)  → the hashes it wants (after its own leading hits)
    sender:   send_blocks(t, wanted, peer)    → SendBlocks: its runner writes the blocks to peer
    receiver: finish_receive(t, frames)       → ReceiveBlocks: its runner writes the ones that
                                                pass their checks; they become findable by hash
    receiver: abandon_receive(t)              (a failed or slow transfer: the blocks go back)

Each side's blocks are held by :class:`~kvserve.kv.peer_seam.PeerTransfers` while the transfer
is open, so the KV manager's check counts them. The block operations go through
``runner.execute`` like a step's, so the runner is the only place the bytes are touched.

Invariants: a transfer that fails leaves both engines as they were (no block lost, none
findable under a hash it was not verified for); a session is moved only while no turn of it runs,
and exists on exactly one engine once ``move_in`` and ``move_out`` are both done.
"""

from __future__ import annotations

from typing import Any

from kvserve.contract import SchedulerOutput
from kvserve.contract.block_ops import BlockOp, NoTierConfigured
from kvserve.kv.session_store import record_of


def _hub(engine: Any) -> Any:
    hub = getattr(engine.runner, "peers", None)
    if hub is None:
        raise NoTierConfigured("moving KV between engines needs the inline runner (--runner inline)")
    return hub


def _run(engine: Any, op: BlockOp) -> Any:
    ops = SchedulerOutput(block_ops=[op])
    result = engine.runner.execute(ops)
    engine.scheduler.update(ops, result)
    return result


def peer_address(engine: Any) -> str:
    """``tcp://host:port`` where this engine's runner takes direct transfers."""
    return str(_hub(engine).address())


def begin_receive(engine: Any, transfer: str, hashes: list[bytes], peer: str) -> list[bytes]:
    hub = _hub(engine)
    op = engine.kv.peers.begin_receive(transfer, hashes, peer)
    if op is None:
        return []
    hub.expect(transfer)
    return list(op.keys)


def finish_receive(engine: Any, transfer: str, frames: list[bytes] | None = None) -> int:
    """Write what arrived for ``transfer`` (``frames``: what Ray carried; None: the direct
    channel already put them in the inbox); returns how many blocks became findable."""
    hub = _hub(engine)
    op = engine.kv.peers.receive_op(transfer)
    if op is None:  # abandoned before the frames came
        hub.forget(transfer)
        return 0
    if frames is not None:
        hub.put(transfer, frames)
    try:
        written = _run(engine, op).received.get(op.peer, 0)
    except Exception:
        engine.kv.peers.close(transfer)
        raise
    return int(engine.kv.peers.finish_receive(transfer, written))


def abandon_receive(engine: Any, transfer: str) -> None:
    engine.kv.peers.close(transfer)
    _hub(engine).forget(transfer)


def send_blocks(engine: Any, transfer: str, hashes: list[bytes], peer: str,
                timeout_s: float = 1.0) -> tuple[list[bytes], int, int]:
    """Send the blocks of the leading ``hashes`` this engine holds to ``peer``. Returns (the
    frames, for a ``ray:`` peer; empty for a direct one), blocks sent, bytes sent. A direct
    send that cannot be delivered within ``timeout_s`` raises ``PeerError``."""
    hub = _hub(engine)
    if engine.kv.has_pending_ops:
        engine._flush_block_ops()  # a copy-on-write still queued for one of these blocks
    op = engine.kv.peers.begin_send(transfer, hashes, peer)
    if op is None:
        return [], 0, 0
    hub.send_timeout_s = timeout_s
    before = hub.bytes_sent
    try:
        _run(engine, op)
    finally:
        engine.kv.peers.close(transfer)
    frames = hub.take_sent(transfer)
    return frames, len(op.block_ids), hub.bytes_sent - before


def move_out(engine: Any, session_id: str) -> dict[str, Any] | None:
    """The record of an idle session this engine will stop serving (None: unknown here or a turn
    of it is running). Its blocks stay findable by hash until the pool reuses them, so a
    ``send_blocks`` of its history can follow; ``forget_moved`` then drops it here."""
    session = engine.kv.sessions.get(session_id)
    if session is None or session.busy:
        return None
    return record_of(session)


def forget_moved(engine: Any, session_id: str) -> bool:
    session = engine.kv.sessions.remove(session_id, keep_record=True)  # the record lives on there
    if session is None:
        return False
    engine.kv.release_session(session)
    return True


def move_in(engine: Any, record: dict[str, Any]) -> bool:
    """Serve the session of ``record`` here from now on (its history's blocks, if received,
    are found by hash on its next turn). False if a session of that id is already here."""
    return bool(engine.kv.sessions.restore([record]))
