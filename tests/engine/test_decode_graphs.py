"""The fixed-shape decode path of CUDA graphs (``kvserve.runner.decode_graphs``), run here without a
graph (``capture=False``): padded batch buckets, padded tables, the device-side mask and the
padding rows' K/V writes give transformers' greedy tokens, batched, across buckets and under a
sliding window; steps it cannot take run eagerly. ``tests/cuda`` runs the same with real graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.contract import ScheduledChunk
from kvserve.engine.llm import LLM
from kvserve.runner.decode_graphs import MIN_BLOCKS, DecodeGraphs, bucket
from kvserve.sampling_params import SamplingParams

from .conftest import hf_greedy

# 5 prompts: the decode batch shrinks 5 -> 1 as they finish (buckets 8, 4, 2, 1), and the longest
# crosses from 8 to 16 blocks of 16 (tables padded to two context buckets).
PROMPTS = [[5, 17, 300, 42], list(range(100, 230)), [7], list(range(1000, 1023)), list(range(40, 61))]
NEW = [20, 12, 40, 6, 28]


def attach(llm: LLM, capture: bool) -> DecodeGraphs:
    """Give the engine's (inline) runner decode graphs, as a CUDA runner builds them."""
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.capacity.block_size, runner.config.sliding_window,
                                 runner.device, bucket(runner.capacity.num_blocks, MIN_BLOCKS), capture=capture)
    return runner.graphs


def greedy(llm: LLM, prompts: list[list[int]], new: list[int]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in new])
    return [o.outputs[0].token_ids for o in outs]


def check_against_hf(model: Path, hf_model, device: str, capture: bool, prompts: list[list[int]],
                     new: list[int]) -> DecodeGraphs:
    """Greedy tokens through the graph path equal transformers' on each prompt alone; the KV
    pool is whole afterwards. Returns the graphs (for what they ran)."""
    llm = LLM(model, dtype="float32", device=device, kv_cache_memory="8MiB", block_size=16)
    graphs = attach(llm, capture)
    got = greedy(llm, prompts, new)
    expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, new)]
    assert got == expected
    llm.engine.kv.check()
    assert llm.engine.kv.usage().used == 0
    return graphs


def test_padded_buckets_give_transformers_tokens(tiny_llama, hf_tiny_llama) -> None:
    graphs = check_against_hf(tiny_llama, hf_tiny_llama, "cpu", False, PROMPTS, NEW)
    assert graphs.replays > 0 and graphs.captures == 0
    seqs = {s for s, _ in graphs.entries}
    blocks = {b for _, b in graphs.entries}
    assert {1, 2, 4, 8} <= seqs, graphs.entries.keys()  # 5 decodes padded to 8, then fewer
    assert blocks == {8, 16}, graphs.entries.keys()      # the 130-token prompt passes 128 tokens


def test_a_sliding_window_is_masked_on_the_device(tiny_mistral, hf_mistral) -> None:
    # Window 16, block 16: the contexts pass the window before any whole block falls behind it.
    prompts, new = [list(range(3, 20)), [9, 8, 7]], [15, 27]
    graphs = check_against_hf(tiny_mistral, hf_mistral, "cpu", False, prompts, new)
    assert graphs.replays > 0


def chunk(**kw) -> ScheduledChunk:
    base = {"request_id": "r", "start": 20, "num_new_tokens": 1, "new_token_ids": [1], "block_ids": [3, 4],
            "num_sample": 1}
    return ScheduledChunk(**{**base, **kw})


@pytest.mark.parametrize("kw", [{"num_new_tokens": 2, "start": 19, "new_token_ids": [1, 2]}, {"num_sample": 0},
                                {"window": 8}, {"sinks": 4}, {"score_queries": 1}, {"block_ids": [None, 4]},
                                {"model_drafts": 1}])
def test_steps_the_fixed_shapes_cannot_express_run_eagerly(kw: dict) -> None:
    graphs = DecodeGraphs(torch.nn.Identity(), 16, None, torch.device("cpu"), 64, capture=False)
    plain = [torch.zeros(1)]
    assert graphs.eligible([chunk()], plain)
    assert not graphs.eligible([chunk(), chunk(**kw)], plain)
    assert not graphs.eligible([chunk()], [object()])  # a codec pool's layer view (not PlainLayerKV)
    assert not graphs.eligible([chunk(start=64 * 16, block_ids=[0] * 65)], plain)  # past max_blocks


def test_auto_attention_takes_matmul_for_one_sequence_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_GRAPH_ATTENTION", raising=False)
    graphs = DecodeGraphs(torch.nn.Identity(), 16, None, torch.device("cpu"), 64, capture=False)
    assert graphs.attention == "auto"
    assert [graphs.variant_for(s) for s in (1, 2, 16)] == ["matmul", "sdpa", "sdpa"]
    monkeypatch.setenv("KVSERVE_GRAPH_ATTENTION", "sdpa")
    forced = DecodeGraphs(torch.nn.Identity(), 16, None, torch.device("cpu"), 64, capture=False)
    assert forced.variant_for(1) == "sdpa"
    monkeypatch.setenv("KVSERVE_GRAPH_ATTENTION", "flash")
    with pytest.raises(ValueError, match="KVSERVE_GRAPH_ATTENTION must be auto, sdpa or matmul"):
        DecodeGraphs(torch.nn.Identity(), 16, None, torch.device("cpu"), 64, capture=False)


def test_bucket() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket(3, MIN_BLOCKS) == MIN_BLOCKS
