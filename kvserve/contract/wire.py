"""Bytes for the step records: msgspec's MessagePack, with JSON for logs and tests.

Why msgspec: it is a well-kept, typed serialiser (vLLM's engine-core IPC uses it) that encodes
these ``Struct`` records several times faster than pickle and decodes them back into the typed
records with validation, so a malformed message fails loudly at the boundary. The records are
also picklable, for ``multiprocessing`` and Ray.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from kvserve.contract.records import RunnerOutput, SchedulerOutput

T = TypeVar("T", SchedulerOutput, RunnerOutput)

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {SchedulerOutput: msgspec.msgpack.Decoder(SchedulerOutput),
             RunnerOutput: msgspec.msgpack.Decoder(RunnerOutput)}


def encode(record: SchedulerOutput | RunnerOutput) -> bytes:
    return _ENCODER.encode(record)


def decode(data: bytes, kind: type[T]) -> T:
    return _DECODERS[kind].decode(data)  # type: ignore[return-value]


def to_json(record: SchedulerOutput | RunnerOutput) -> bytes:
    return msgspec.json.encode(record)


def from_json(data: bytes, kind: type[T]) -> T:
    return msgspec.json.decode(data, type=kind)
