"""The engine on a CUDA device: the model and its KV live there; greedy tokens equal transformers'
and the CPU engine's on tiny random-weight models (fp32, TF32 off), with decode steps replayed as
CUDA graphs and without them. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.engine.conftest import hf_greedy
from tests.engine.test_decode_graphs import NEW, PROMPTS, check_against_hf, greedy

pytestmark = pytest.mark.cuda


def test_the_model_runs_on_cuda_and_matches_cpu_greedy_tokens(tiny_llama: Path) -> None:
    gpu = LLM(tiny_llama, dtype="float32", device="cuda", kv_cache_memory="8MiB", block_size=16)
    assert gpu.engine.device.type == "cuda"
    assert {p.device.type for p in gpu.engine.runner.model.parameters()} == {"cuda"}
    assert gpu.engine.runner.graphs is not None  # on by default on CUDA
    gpu_tokens = greedy(gpu, PROMPTS, NEW)
    gpu.engine.kv.check()
    assert gpu.engine.kv.usage().used == 0
    assert gpu.engine.runner.graphs.captures > 0
    cpu = LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_memory="8MiB", block_size=16)
    assert gpu_tokens == greedy(cpu, PROMPTS, NEW)
    assert [len(t) for t in gpu_tokens] == NEW


@pytest.mark.parametrize("variant", ["auto", "sdpa", "matmul"])
def test_decode_graphs_replay_and_match_transformers(monkeypatch: pytest.MonkeyPatch, tiny_llama: Path,
                                                     hf_tiny_llama, variant: str) -> None:
    monkeypatch.setenv("KVSERVE_GRAPH_ATTENTION", variant)
    graphs = check_against_hf(tiny_llama, hf_tiny_llama, "cuda", True, PROMPTS, NEW)
    assert graphs.attention == variant
    assert graphs.captures == len(graphs.entries) >= 4
    assert graphs.replays > 3 * graphs.captures
    assert all(e.graph is not None for e in graphs.entries.values())


def test_decode_graphs_under_a_sliding_window(tiny_mistral: Path, hf_mistral) -> None:
    graphs = check_against_hf(tiny_mistral, hf_mistral, "cuda", True, [list(range(3, 20)), [9, 8, 7]], [15, 27])
    assert graphs.captures > 0


def test_eager_cuda_batched_and_chunked_match_transformers(monkeypatch: pytest.MonkeyPatch, tiny_llama: Path,
                                                           hf_tiny_llama) -> None:
    monkeypatch.setenv("KVSERVE_CUDA_GRAPHS", "0")
    llm = LLM(tiny_llama, dtype="float32", device="cuda", kv_cache_memory="8MiB", block_size=16,
              max_num_batched_tokens=7)
    assert llm.engine.runner.graphs is None
    assert greedy(llm, PROMPTS, NEW) == [hf_greedy(hf_tiny_llama, p, n) for p, n in zip(PROMPTS, NEW)]
    llm.engine.kv.check()


def test_greedy_ids_on_the_device_equal_the_host_path(tiny_llama: Path) -> None:
    """A plain greedy batch takes its argmax on the GPU; asking for logprobs sends the logits to
    the host path: the same tokens either way."""
    llm = LLM(tiny_llama, dtype="float32", device="cuda", kv_cache_memory="8MiB", block_size=16)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with_lp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    a = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], plain)
    b = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], with_lp)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(o.outputs[0].logprobs for o in b)


def test_bf16_graphs_follow_eager_up_to_a_near_tie(monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> None:
    """bf16 on the GPU, graphs against eager: the same greedy tokens until, at most, a position
    where eager's two best tokens are within bf16's noise (the two attend in a different order, so
    a near-tie may flip; on an H200 one of five prompts flipped at its third token). There the
    graph's token must be one of eager's best and as likely, within 0.1 in log probability."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5) for n in NEW]

    def run() -> tuple[LLM, list]:
        llm = LLM(tiny_llama, dtype="bfloat16", device="cuda", kv_cache_memory="8MiB", block_size=16)
        return llm, [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]

    graphs, got = run()
    monkeypatch.setenv("KVSERVE_CUDA_GRAPHS", "0")
    eager, ref = run()
    assert graphs.engine.runner.graphs.captures > 0 and eager.engine.runner.graphs is None
    same = 0
    for a, b in zip(got, ref):
        j = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if j is None:
            same += 1
            continue
        assert j >= 1, "the first token comes from the same (eager) prefill"
        top = b.logprobs[j]
        assert a.token_ids[j] in top and top[b.token_ids[j]] - top[a.token_ids[j]] < 0.1, (j, top)
    assert same >= 3
