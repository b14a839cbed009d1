"""Blocks moved between two engines by ``SendBlocks`` / ``ReceiveBlocks`` (the P/D split's and a
session move's mechanism), over the direct TCP channel and the object-store-style outbox: the
receiver serves the prompt from the received blocks with the tokens it computes alone, every
block stays accounted for after every step, and a bad, late or stranger's transfer changes
nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine import kv_transfer as kt
from kvserve.engine.engine import LLMEngine
from kvserve.kv.hashing import hash_full_blocks, request_root
from kvserve.runner.peers import PeerError, PeerHub
from kvserve.sampling_params import SamplingParams
from tests.engine.conftest import write_tiny_llama

BS = 4
PROMPT = list(range(300, 339))  # 39 tokens: 9 full blocks


def engine(model: Path, num_blocks: int = 48) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu", seed=0, num_threads=1,
                                  cache=CacheConfig(block_size=BS, num_blocks_override=num_blocks),
                                  scheduler=SchedulerConfig(max_model_len=min(128, num_blocks * BS))))


def run(e: LLMEngine, prompt: list[int], rid: str, n: int = 5) -> tuple[list[int], int]:
    e.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), request_id=rid)
    while e.has_unfinished_requests():
        outs = e.step()
        e.kv.check()
        for o in outs:
            if o.request_id == rid and o.finished:
                return list(o.outputs[0].token_ids), o.num_cached_tokens
    raise AssertionError("no output")


def hashes(e: LLMEngine, prompt: list[int]) -> list[bytes]:
    return hash_full_blocks(prompt, BS, request_root(e.kv.root_key, None, None))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("peers") / "m")


def transfer(src: LLMEngine, dst: LLMEngine, prompt: list[int], t: str, channel: str) -> int:
    hs = hashes(src, prompt)
    peer = f"{kt.peer_address(dst)}/{t}" if channel == "tcp" else f"ray:{t}"
    wanted = kt.begin_receive(dst, t, hs, peer)
    dst.kv.check()
    frames, sent, nbytes = kt.send_blocks(src, t, wanted, peer)
    src.kv.check()
    assert sent == len(wanted) and nbytes > 0
    assert (frames == []) == (channel == "tcp")
    got = kt.finish_receive(dst, t, frames if channel == "ray" else None)
    dst.kv.check()
    return got


@pytest.mark.parametrize("channel", ["tcp", "ray"])
def test_received_blocks_serve_the_prompt_with_the_same_tokens(tiny_llama: Path, channel: str) -> None:
    src, dst = engine(tiny_llama), engine(tiny_llama)
    ref, _ = run(engine(tiny_llama), PROMPT, "ref")
    run(src, PROMPT, "prefill", n=1)
    assert transfer(src, dst, PROMPT, f"t-{channel}", channel) == 9
    assert dst.kv.pool.usage().cached_free == 9  # findable, held by nobody
    tokens, cached = run(dst, PROMPT, "decode")
    assert tokens == ref
    assert cached == 36
    # a second transfer of the same prompt wants nothing: the receiver holds every block
    assert kt.begin_receive(dst, "again", hashes(src, PROMPT), "ray:again") == []


def test_only_the_blocks_after_the_receivers_own_prefix_are_wanted(tiny_llama: Path) -> None:
    src, dst = engine(tiny_llama), engine(tiny_llama)
    run(src, PROMPT, "p", n=1)
    run(dst, PROMPT[:16], "own", n=1)  # the receiver computed the first 4 blocks itself
    wanted = kt.begin_receive(dst, "t", hashes(src, PROMPT), "ray:t")
    assert wanted == hashes(src, PROMPT)[4:]
    kt.abandon_receive(dst, "t")
    dst.kv.check()
    assert dst.kv.peers.held_refs() == 0


def test_a_corrupt_block_stops_the_receive_there(tiny_llama: Path) -> None:
    src, dst = engine(tiny_llama), engine(tiny_llama)
    run(src, PROMPT, "p", n=1)
    wanted = kt.begin_receive(dst, "t", hashes(src, PROMPT), "ray:t")
    frames, _, _ = kt.send_blocks(src, "t", wanted, "ray:t")
    bad = bytearray(frames[3])
    bad[len(bad) // 2] ^= 0xFF
    frames[3] = bytes(bad)
    assert kt.finish_receive(dst, "t", frames) == 3  # blocks 0-2 verified, 3 failed its checksum
    dst.kv.check()
    _, cached = run(dst, PROMPT, "d")
    assert cached == 12


def test_frames_for_another_prompt_are_refused(tiny_llama: Path) -> None:
    src, dst = engine(tiny_llama), engine(tiny_llama)
    other = list(range(700, 739))
    run(src, other, "p", n=1)
    wanted = kt.begin_receive(dst, "t", hashes(src, PROMPT), "ray:t")
    # the sender is asked for the wrong hashes' frames: it holds none of PROMPT's blocks
    assert kt.send_blocks(src, "t", wanted, "ray:t") == ([], 0, 0)
    frames, _, _ = kt.send_blocks(src, "u", hashes(src, other), "ray:u")
    assert kt.finish_receive(dst, "t", frames) == 0  # every frame names another hash
    dst.kv.check()
    assert dst.kv.pool.usage().cached_free == 0


def test_a_stranger_or_late_transfer_is_refused_on_the_direct_channel(tiny_llama: Path) -> None:
    src, dst = engine(tiny_llama), engine(tiny_llama)
    run(src, PROMPT, "p", n=1)
    addr = kt.peer_address(dst)
    with pytest.raises(PeerError, match="refused"):
        kt.send_blocks(src, "nobody-expects-this", hashes(src, PROMPT), f"{addr}/nobody-expects-this")
    src.kv.check()
    assert src.kv.peers.held_refs() == 0
    wanted = kt.begin_receive(dst, "late", hashes(src, PROMPT), f"{addr}/late")
    kt.abandon_receive(dst, "late")  # the decode side gave up before the sender came
    with pytest.raises(PeerError, match="refused"):
        kt.send_blocks(src, "late", wanted, f"{addr}/late")
    assert kt.finish_receive(dst, "late") == 0
    dst.kv.check()
    assert dst.kv.pool.usage().cached_free == 0 and dst.kv.peers.held_refs() == 0


def test_a_dead_receiver_fails_the_send_within_its_timeout(tiny_llama: Path) -> None:
    src = engine(tiny_llama)
    run(src, PROMPT, "p", n=1)
    hub = PeerHub()
    addr = hub.address()
    hub.close()  # nobody listens there any more
    with pytest.raises(PeerError):
        kt.send_blocks(src, "t", hashes(src, PROMPT), f"{addr}/t", timeout_s=0.5)
    src.kv.check()


def test_a_receive_takes_at_most_half_the_free_blocks(tiny_llama: Path) -> None:
    src, dst = engine(tiny_llama), engine(tiny_llama, num_blocks=12)
    run(src, PROMPT, "p", n=1)
    wanted = kt.begin_receive(dst, "t", hashes(src, PROMPT), "ray:t")
    assert len(wanted) == 6
    frames, _, _ = kt.send_blocks(src, "t", wanted, "ray:t")
    assert kt.finish_receive(dst, "t", frames) == 6
    dst.kv.check()


def test_an_incoming_transfer_nobody_finishes_expires(tiny_llama: Path) -> None:
    src, dst = engine(tiny_llama), engine(tiny_llama)
    run(src, PROMPT, "p", n=1)
    kt.begin_receive(dst, "forgotten", hashes(src, PROMPT), "ray:forgotten")
    assert dst.kv.peers.held_refs() == 9
    dst.kv.peers.expire_s = 0.0
    run(dst, [1, 2, 3], "other", n=1)  # any step closes it
    assert dst.kv.peers.held_refs() == 0
    frames, _, _ = kt.send_blocks(src, "forgotten", hashes(src, PROMPT), "ray:forgotten")
    assert kt.finish_receive(dst, "forgotten", frames) == 0  # too late: nothing is written
    dst.kv.check()
