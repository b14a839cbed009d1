"""AsyncLLMEngine on its own: streaming, errors, cancellation, idle ticks, a dying engine."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from kvserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, FinishedRequest
from kvserve.engine.engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from tests.server.conftest import BLOCK_SIZE, engine_config
from tests.step_gate import StepGate


class Recorder:
    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.gaps: list[float] = []
        self.finished: list[FinishedRequest] = []

    def on_first_token(self, ttft_s: float, now: float) -> None:
        self.ttfts.append(ttft_s)

    def on_token_gaps(self, gaps_s: list[float], now: float) -> None:
        self.gaps.extend(gaps_s)

    def on_finished(self, req: FinishedRequest, now: float) -> None:
        self.finished.append(req)


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLMEngine:
    return LLMEngine(engine_config(tiny_model))


@pytest.fixture()
def aengine(llm):
    ae = AsyncLLMEngine(llm, idle_tick_s=0.05)
    ae.start()
    yield ae
    ae.shutdown()
    assert not llm.has_unfinished_requests()


async def wait_for(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_stream_grows_then_finishes_and_listeners_see_every_token(aengine):
    rec = Recorder()
    aengine.listeners.append(rec)

    async def main():
        stream = await aengine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        return [out async for out in stream]

    outs = asyncio.run(main())
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert len(rec.ttfts) == 1 and len(rec.gaps) == 5 and all(g >= 0 for g in rec.gaps)
    [fin] = rec.finished
    assert fin.finish_reason == "length" and fin.generation_tokens == 6 and fin.prompt_tokens == 4
    assert fin.kv_gib_s > 0 and 0 <= fin.queue_s <= fin.ttft_s <= fin.e2e_s


def test_bad_input_raises_and_queues_nothing(aengine):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await aengine.add_request(list(range(3, 300)), SamplingParams(max_tokens=4))
        return await aengine.snapshot()

    snap = asyncio.run(main())
    assert snap.num_waiting == 0 and snap.num_running == 0 and aengine.num_waiting == 0


def test_cancelled_consumer_aborts_and_blocks_come_back(aengine):
    done: list = []

    async def main():
        stream = await aengine.add_request([9, 10, 11], SamplingParams(max_tokens=200, ignore_eos=True),
                                           on_done=done.append)

        first = asyncio.Event()

        async def consume():
            async for _ in stream:
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 20)
        task.cancel()
        await wait_for(lambda: bool(done))
        return await aengine.snapshot()

    snap = asyncio.run(main())
    assert done[0].outputs[0].finish_reason == "abort" and len(done[0].outputs[0].token_ids) < 200
    assert snap.blocks_used == snap.blocks_pinned and snap.num_running == 0


def test_snapshot_counts_tokens_held_once_per_shared_block(aengine, llm):
    """Three samples of a 10-token prompt (blocks of 4): the two full prompt blocks are shared and
    counted once; everything past token 8 is each sample's own (the partial block is copied on
    write). The engine is held between steps while the snapshot is read."""
    assert BLOCK_SIZE == 4
    prompt = list(range(700, 710))

    def computed(e: LLMEngine) -> dict[str, int]:
        return {r.request_id: r.num_computed_tokens for r in e.scheduler.running}

    done: list = []

    async def main():
        with StepGate(llm) as gate:
            stream = await aengine.add_request(prompt, SamplingParams(n=3, max_tokens=50, temperature=1.0, seed=1,
                                                                      ignore_eos=True), on_done=done.append)
            for _ in range(40):  # one step at a time until every sample is past its prompt
                gate.allow(1)
                await asyncio.to_thread(gate.wait_steps, gate.steps_taken + 1)
                counts = await aengine.call(computed)
                if len(counts) == 3 and min(counts.values()) > len(prompt):
                    break
            else:
                pytest.fail(f"the samples did not all decode: {counts}")
            snap = await aengine.snapshot()
            again = await aengine.call(computed)
        stream.abort()
        await wait_for(lambda: bool(done))  # the abort's last output reaches this loop before it closes
        return counts, again, snap

    counts, again, snap = asyncio.run(main())
    assert again == counts  # nothing moved while the gate was closed
    assert snap.num_running == 3 and snap.blocks_pinned == 0
    own = [c - 8 for c in counts.values()]  # tokens past the two shared blocks, per sample
    assert snap.tokens_held == 8 + sum(own)
    assert snap.blocks_used == 2 + sum(-(-t // 4) for t in own)
    assert snap.slots_in_used_blocks == 4 * snap.blocks_used
    assert snap.tokens_held < snap.slots_in_used_blocks  # the partial tail blocks
    assert snap.fragmentation_ratio == pytest.approx(1 - snap.tokens_held / (4 * snap.blocks_used))
    assert [c.finish_reason for c in done[0].outputs] == ["abort"] * 3


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_idle_sessions_expire_without_traffic(tiny_model):
    """The sessions' clock is the test's: the session outlives idle ticks until the test moves the
    clock past the timeout, then the next idle tick (no request in flight) releases it."""
    cfg = engine_config(tiny_model)
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, session_idle_timeout_s=30.0))
    llm = LLMEngine(cfg)
    clock = FakeClock()
    llm.kv.sessions.clock = clock
    ae = AsyncLLMEngine(llm, idle_tick_s=0.05)
    ae.start()
    try:
        async def main():
            with StepGate(llm) as gate:
                gate.open()
                stream = await ae.add_request([4, 5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0),
                                              session_id="idle")
                await stream.result()
                before = await ae.snapshot()
                ticks = gate.steps_taken
                await asyncio.to_thread(gate.wait_steps, ticks + 3)  # three idle ticks, no traffic
                kept = await ae.snapshot()
                clock.t += 31.0
                await asyncio.to_thread(gate.wait_steps, gate.steps_taken + 2)
                return before, kept, await ae.snapshot(), await ae.list_sessions()

        before, kept, snap, sessions = asyncio.run(main())
        assert before.blocks_pinned > 0 and kept.blocks_pinned == before.blocks_pinned  # not yet idle long enough
        assert kept.sessions_expired == 0
        assert snap.blocks_pinned == 0 and snap.sessions_expired == 1 and snap.blocks_used == 0
        assert [(s.session_id, s.resident) for s in sessions] == [("idle", False)]  # history kept, KV released
    finally:
        ae.shutdown()


def test_a_failing_engine_fails_streams_and_refuses_new_work(tiny_model):
    llm = LLMEngine(engine_config(tiny_model))
    ae = AsyncLLMEngine(llm, idle_tick_s=30.0)  # no idle step before the request arrives

    def boom():
        raise RuntimeError("device lost")

    llm.step = boom  # type: ignore[method-assign]
    ae.start()

    async def main():
        stream = await ae.add_request([5, 6], SamplingParams(max_tokens=3))
        with pytest.raises(EngineDeadError, match="device lost"):
            await stream.result()
        with pytest.raises(EngineDeadError):
            await ae.add_request([5, 6], SamplingParams(max_tokens=3))

    try:
        asyncio.run(main())
        assert not ae.alive and isinstance(ae.error, RuntimeError)
    finally:
        ae.shutdown()
