"""Moving a prompt's KV between replicas (the prefill/decode split), through the KV tiers.

The prefill replica computed the prompt; write-through saved each full block as a self-describing
object (:mod:`kvserve.kv.tiers.object_format`: header, payload, checksum, root key) in its first
tier. ``export_objects`` reads those objects; Ray carries them (the object store, replica to
replica); ``import_objects`` puts them into the decode replica's first tier and tells its tier
index, so the decode request's prefix lookup loads them (``LoadBlock``, verified) instead of
computing them. An object that fails its checksum there is deleted and recomputed, never served.

Runs on the engine thread (a command). Needs the inline runner and a tier (``--kv-host-memory``).
"""

from __future__ import annotations

from typing import Any

from kvserve.contract.block_ops import NoTierConfigured
from kvserve.contract.records import TierEvent


def _stack(engine: Any) -> Any:
    stack = getattr(engine.runner, "tiers", None)
    if not stack:
        raise NoTierConfigured("a prefill/decode split needs a KV tier on every replica (--kv-host-memory) "
                               "and the inline runner")
    return stack


def export_objects(engine: Any, keys: list[bytes]) -> dict[bytes, bytes]:
    if engine.kv.has_pending_ops:
        engine._flush_block_ops()  # the last blocks' saves, if the prefill's step left them queued
    stack, out = _stack(engine), {}
    for key in keys:
        data = next((d for t in stack.tiers if (d := t.get(key)) is not None), None)
        if data is None:
            break  # a prefix only: a block after a hole could not be used
        out[key] = data
    return out


def import_objects(engine: Any, objects: dict[bytes, bytes]) -> tuple[int, int]:
    tier = _stack(engine).tiers[0]
    events: list[TierEvent] = []
    taken = nbytes = 0
    for key, data in objects.items():
        evicted = tier.put(key, data)
        events += [TierEvent("removed", tier.name, k) for k in evicted if k != key]
        if key not in evicted:
            events.append(TierEvent("stored", tier.name, key, len(data)))
            taken, nbytes = taken + 1, nbytes + len(data)
    engine.kv.tiers.apply(events)
    return taken, nbytes
