"""KV tiers through the engine: blocks evicted from a small pool come back from host memory or
disk instead of being recomputed, a restarted engine finds the disk tier's blocks, and a corrupt
object is detected, deleted and recomputed: the tokens are those of an uncached run every time."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from tests.engine.conftest import write_tiny_llama

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
A = {"prompt_token_ids": list(range(100, 160))}  # 60 tokens: 15 blocks of 4
FILLERS = [{"prompt_token_ids": list(range(1000 + 70 * i, 1060 + 70 * i))} for i in range(3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiers") / "m")


def engine(model: Path, **kw) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(model), dtype="float32", num_blocks=24, block_size=4, num_threads=1, **kw)


def run(llm: LLM, prompt: dict) -> tuple[list[int], dict[str, int], int]:  # type: ignore[type-arg]
    out = llm.generate(prompt, GREEDY)[0]
    llm.engine.kv.check()
    return out.outputs[0].token_ids, out.kv_hit_tokens, out.num_cached_tokens


def evict_a(llm: LLM) -> None:
    for p in FILLERS:  # each fills most of the 24-block pool: A's blocks are reused
        run(llm, p)


def test_blocks_evicted_from_the_pool_come_back_from_host_memory(model: Path) -> None:
    reference = run(engine(model), A)[0]
    llm = engine(model, kv_host_memory="8MiB")
    assert run(llm, A)[0] == reference
    evict_a(llm)
    tokens, hits, cached = run(llm, A)
    assert tokens == reference
    assert hits.get("host", 0) >= 14 * 4 - 4 and cached >= 14 * 4  # all but the last block and a token
    assert llm.engine.kv.tiers.index.count("host") > 0


def test_a_restarted_engine_loads_from_the_disk_tier(model: Path, tmp_path: Path) -> None:
    reference = run(engine(model), A)[0]
    first = engine(model, kv_disk_dir=tmp_path)
    run(first, A)
    del first
    files = list((tmp_path / "blocks").glob("*.kvb"))
    assert len(files) >= 14
    second = engine(model, kv_disk_dir=tmp_path)  # a new engine: its pool is empty, its disk is not
    assert second.engine.kv.tiers.index.count("disk") == len(files)
    tokens, hits, cached = run(second, A)
    assert tokens == reference and hits.get("disk", 0) >= 14 * 4 - 4 and cached >= 14 * 4 - 4


def test_a_corrupt_object_is_detected_deleted_and_recomputed(model: Path, tmp_path: Path) -> None:
    reference = run(engine(model), A)[0]
    run(engine(model, kv_disk_dir=tmp_path), A)
    files = sorted((tmp_path / "blocks").glob("*.kvb"), key=lambda p: p.stat().st_mtime)
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    files[-1].write_bytes(files[-1].read_bytes()[:-7])  # and one truncated
    llm = engine(model, kv_disk_dir=tmp_path)
    tokens, hits, _ = run(llm, A)
    assert tokens == reference  # never served a corrupt block
    disk = llm.engine.runner.tiers.tiers[0]
    assert disk.stats.checksum_failures == 1
    assert 0 < hits.get("disk", 0) < 14 * 4  # the prefix up to the corrupt block came from disk
    # the corrupt object was deleted, the block recomputed and written through again: valid now
    from kvserve.kv.tiers import object_format

    key = bytes.fromhex(victim.name.removesuffix(".kvb"))
    object_format.decode(victim.read_bytes(), root=llm.engine.kv.root_key, block_hash=key)


def test_another_model_never_loads_these_blocks(model: Path, tmp_path: Path) -> None:
    run(engine(model, kv_disk_dir=tmp_path), A)
    other = write_tiny_llama(tmp_path / "other", seed=1)
    llm = engine(other, kv_disk_dir=tmp_path)
    _, hits, cached = run(llm, A)
    assert hits.get("disk", 0) == 0 and cached == 0  # its root key differs: no hash matches


def test_loading_makes_room_by_releasing_idle_sessions(model: Path) -> None:
    """Idle sessions holding most of the pool do not starve a load: they are released (their KV
    is in the tier too) and the whole prefix is loaded, not recomputed."""
    reference = run(engine(model), A)[0]
    llm = engine(model, kv_host_memory="8MiB")
    run(llm, A)
    for i, p in enumerate(FILLERS[:2]):  # two idle sessions now pin most of the 24 blocks
        llm.generate(p, GREEDY, session_id=f"idle{i}")
    tokens, hits, _ = run(llm, A)
    assert tokens == reference and hits.get("host", 0) + hits.get("pool", 0) >= 14 * 4
    assert llm.engine.kv.sessions.stats.evicted >= 1


def test_the_process_runner_serves_tiers_too(model: Path, tmp_path: Path) -> None:
    reference = run(engine(model), A)[0]
    run(engine(model, kv_disk_dir=tmp_path), A)
    with engine(model, kv_disk_dir=tmp_path, runner="process") as llm:  # the child rebuilt the index
        tokens, hits, _ = run(llm, A)
    assert tokens == reference and hits.get("disk", 0) >= 14 * 4 - 4


def test_write_back_saves_a_block_only_when_the_pool_evicts_it(model: Path, tmp_path: Path) -> None:
    reference = run(engine(model), A)[0]
    llm = engine(model, kv_host_memory="8MiB", kv_tier_write="back")
    run(llm, A)
    assert llm.engine.kv.tiers.index.count("host") == 0  # nothing saved while A's blocks sit in the pool
    evict_a(llm)
    assert llm.engine.kv.tiers.index.count("host") >= 14  # evicted, so saved on the way out
    tokens, hits, _ = run(llm, A)
    assert tokens == reference and hits.get("host", 0) >= 14 * 4 - 4
    llm.engine.kv.check()


def test_write_back_spills_what_the_host_tier_evicts_to_disk(model: Path, tmp_path: Path) -> None:
    from kvserve.contract import BlockPayload
    from kvserve.kv.tiers.disk import DiskTier
    from kvserve.kv.tiers.host import HostTier
    from kvserve.kv.tiers.stack import TierStack

    host, disk = HostTier(2500), DiskTier(tmp_path, 1 << 20, fsync=False)
    stack = TierStack([host, disk], b"r" * 16, write="back")
    for i in range(10):
        stack.save(i.to_bytes(16, "little"), b"", BlockPayload("int8", 4, 1, 8, 4, [b"k" * 400], [b"v" * 8]))
        host.check()
        disk.check()
    assert len(host) < 10 and len(host) + len(disk) == 10  # host holds the newest, disk the spilled rest
    assert all(stack.load(i.to_bytes(16, "little"))[0] is not None for i in range(10))
