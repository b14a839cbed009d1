"""The step records are plain data: they round-trip through pickle, msgpack and JSON unchanged."""

from __future__ import annotations

import pickle

import pytest

from kvserve.contract import (
    CopyBlock,
    LoadBlock,
    NewRequest,
    ReceiveBlocks,
    RunnerOutput,
    SampledTokens,
    SaveBlock,
    ScheduledChunk,
    SchedulerOutput,
    SendBlocks,
    TokenLogprobs,
    wire,
)
from kvserve.sampling_params import SamplingParams


def scheduler_output() -> SchedulerOutput:
    params = SamplingParams(n=1, temperature=0.7, top_k=5, top_p=0.9, seed=11, max_tokens=9, stop=("x", "yz"),
                            stop_token_ids=(3,), logprobs=2)
    return SchedulerOutput(
        step_id=42,
        new_requests=[NewRequest("a", 5, params, 123456789, "int8", (2, 7))],
        chunks=[ScheduledChunk("a", 0, 5, [1, 2, 3, 4, 5], [4, 9], 1), ScheduledChunk("b", 17, 1, [8], [1, 2, 3, 5], 1),
                ScheduledChunk("c", 32, 16, [], [6, 7, 8], 0)],
        block_ops=[CopyBlock(3, 4), SaveBlock(5, b"\x00\xffkey"), LoadBlock(b"k2", 6), SendBlocks([1, 2], "peer-1"),
                   ReceiveBlocks([3], "peer-0")],
        finished=["z"], preempted=["y"],
    )


def runner_output() -> RunnerOutput:
    return RunnerOutput(step_id=42, sampled={"a": SampledTokens([5, 6], [TokenLogprobs(-0.5, {5: -0.5, 9: -1.25}),
                                                                         TokenLogprobs(-0.1, {})]),
                                             "b": SampledTokens([8])},
                        failed={"c": "RuntimeError('boom')"}, block_scores={"a": [0.5, 0.25]})


ROUND_TRIPS = {
    "pickle": lambda x, kind: pickle.loads(pickle.dumps(x)),
    "msgpack": lambda x, kind: wire.decode(wire.encode(x), kind),
    "json": lambda x, kind: wire.from_json(wire.to_json(x), kind),
}


@pytest.mark.parametrize("how", sorted(ROUND_TRIPS))
def test_both_records_round_trip(how: str) -> None:
    so, ro = scheduler_output(), runner_output()
    so2, ro2 = ROUND_TRIPS[how](so, SchedulerOutput), ROUND_TRIPS[how](ro, RunnerOutput)
    assert so2 == so and ro2 == ro
    # sampling parameters come back as the same frozen dataclass, with every value
    assert so2.new_requests[0].sampling == so.new_requests[0].sampling
    assert [type(op) for op in so2.block_ops] == [CopyBlock, SaveBlock, LoadBlock, SendBlocks, ReceiveBlocks]
    assert ro2.sampled["a"].logprobs[0].top == {5: -0.5, 9: -1.25}


def test_a_malformed_message_fails_at_the_boundary() -> None:
    import msgspec

    data = wire.to_json(scheduler_output()).replace(b'"step_id":42', b'"step_id":"42"')
    with pytest.raises(msgspec.ValidationError):
        wire.from_json(data, SchedulerOutput)
