"""The native layer loop (kvserve/model/decode_stack.py) computes exactly what the per-layer path
computes: same tokens, bit-equal log-probabilities, the same KV, for decodes, batches of decodes
and short prefill chunks; and it stands aside wherever a layer would run something else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kv.layer_kv import CodecLayerKV
from kvserve.model import decode_stack
from kvserve.model.tiled_gemm import tiled_gemm_available

from .conftest import write_tiny_llama

CASES = {"llama-gqa": ("Llama", {}), "llama-mqa-bias": ("Llama", {"num_key_value_heads": 1, "attention_bias": True}),
         "qwen2-bias-tied": ("Qwen2", {"tie_word_embeddings": True}),
         "mistral-window": ("Mistral", {"sliding_window": 16}), "qwen3-qknorm": ("Qwen3", {"head_dim": 32})}
VOCAB = 4096
Checkpoint = Callable[[str], Path]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            arch, extra = CASES[case]
            made[case] = write_tiny_llama(tmp_path_factory.mktemp(case), arch=arch, **extra)
        return made[case]

    return get


def random_prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
pytestmark = pytest.mark.skipif(not tiled_gemm_available() or decode_stack._ext() is None,
                                reason="needs the tiled kernel and the native stack")


@pytest.fixture
def stack_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every step the stack ran (a spy on decode_stack.run_layers)."""
    ran: list[int] = []
    real = decode_stack.run_layers

    def spy(model: Any, h: torch.Tensor, *args: Any) -> torch.Tensor | None:
        out = real(model, h, *args)
        if out is not None:
            ran.append(h.shape[0])
        return out

    monkeypatch.setattr(decode_stack, "run_layers", spy)
    return ran


def generate(path: Path, prompts: list[list[int]], kv_press: str | None = None, **kw: Any) -> list[Any]:
    """Greedy, with the native attention forced: the stack runs only on its plan, and the measured
    choice for a tiny model's prefill chunk is torch's SDPA on some CPUs (an AMX Xeon)."""
    kw.setdefault("attention_backend", "native")
    llm = LLM(path, dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False, num_threads=2, **kw)
    sp = SamplingParams(max_tokens=10, temperature=0, logprobs=3, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, kv_press=kv_press)


@pytest.mark.parametrize("case", ["llama-gqa", "llama-mqa-bias", "qwen2-bias-tied", "mistral-window"])
def test_the_stack_is_bit_equal_to_the_per_layer_path(case: str, checkpoint: Checkpoint,
                                                      monkeypatch: pytest.MonkeyPatch, stack_calls: list[int]) -> None:
    path = checkpoint(case)
    monkeypatch.setenv("KVSERVE_GEMM", "kvserve_tiled")  # a tiny model: force the plan the stack runs on
    prompts = [random_prompt(n, seed=n) for n in (5, 23, 70)]  # 70: its first chunk per layer
    stacked = generate(path, prompts) + generate(path, prompts[1:2])
    assert stack_calls and max(stack_calls) <= decode_stack.MAX_ROWS
    assert {1, 3, 23} <= set(stack_calls)  # a lone decode, a batch of three, a prompt's chunk
    assert any(64 < r <= 128 for r in stack_calls)  # the three prompts' first step (98 rows)
    n = len(stack_calls)
    monkeypatch.setenv("KVSERVE_DECODE_STACK", "0")
    per_layer = generate(path, prompts) + generate(path, prompts[1:2])
    assert len(stack_calls) == n  # switched off: never ran
    for a, b in zip(stacked, per_layer):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bit-equal, not close


def test_it_stands_aside_where_a_layer_runs_something_else(checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch,
                                                           stack_calls: list[int]) -> None:
    """Per-head q/k norms (Qwen3), projections on torch's matmul, sinks (the torch path): per layer."""
    monkeypatch.setenv("KVSERVE_GEMM", "kvserve_tiled")
    generate(checkpoint("qwen3-qknorm"), [random_prompt(9)])
    path = checkpoint("llama-gqa")
    monkeypatch.setenv("KVSERVE_GEMM", "native")
    generate(path, [random_prompt(9)])
    monkeypatch.setenv("KVSERVE_GEMM", "kvserve_tiled")
    generate(path, [random_prompt(9)], kv_press="sinks:4,8")  # sinks: attention on the torch path
    assert stack_calls == []
    generate(path, [random_prompt(9)])  # and the same model otherwise: stacked
    assert stack_calls


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_codec_pools_are_bit_equal_too(codec: str, checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch,
                                       stack_calls: list[int]) -> None:
    """A codec pool: rope natively, the pool's own write called back per layer (int8: written
    natively, no call back), the kernel reading the codec; the same log-probabilities as the
    per-layer path."""
    path = checkpoint("qwen2-bias-tied")
    monkeypatch.setenv("KVSERVE_GEMM", "kvserve_tiled")
    native_writes: list[bool] = []
    real_args = CodecLayerKV.int8_write_args
    monkeypatch.setattr(CodecLayerKV, "int8_write_args",
                        lambda self: native_writes.append(real_args(self) is not None) or real_args(self))
    prompts = [random_prompt(n, seed=n) for n in (5, 40)]
    stacked = generate(path, prompts, kv_cache_dtype=codec)
    assert 2 in stack_calls
    assert native_writes and all(native_writes) == (codec == "int8") and any(native_writes) == (codec == "int8")
    monkeypatch.setenv("KVSERVE_DECODE_STACK", "0")
    per_layer = generate(path, prompts, kv_cache_dtype=codec)
    for a, b in zip(stacked, per_layer):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_a_module_hook_sees_every_layer(checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch,
                                        stack_calls: list[int]) -> None:
    """A forward hook (a profiler's) keeps the per-layer path, so it fires."""
    path = checkpoint("llama-gqa")
    monkeypatch.setenv("KVSERVE_GEMM", "kvserve_tiled")
    llm = LLM(path, dtype="bfloat16", kv_cache_memory="64MiB", enable_prefix_caching=False)
    fired: list[int] = []
    model = llm.engine.runner.model
    model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: fired.append(1))
    decode_stack.forget(model)
    llm.generate([{"prompt_token_ids": random_prompt(9)}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(fired) == 4 and stack_calls == []
