"""Quantized KV on a GPU: each codec's round trip there equals the CPU's (codes and scales come from
the same IEEE operations), and the engine with an int8 / fp8 / int4 pool on CUDA gives the CPU
engine's greedy tokens (fp32 model, TF32 off), with no block leaked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.kv.quant import make_codec, round_trip
from kvserve.sampling_params import SamplingParams
from tests.quant.test_codecs import kv_like

pytestmark = pytest.mark.cuda
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 17, 42, 7, 99, 3, 11, 60], [8, 8, 300, 12, 4, 77, 1000], [31, 41, 59, 26, 53, 58, 97]]


def one_code(name: str, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """An upper bound on one code step of ``name`` at each element of ``x`` (blocks ``[m, bs, kvh,
    d]``), its scale taken over ``dim`` (-1: per token; 1: int4 keys, per channel over a block)."""
    amax = x.abs().amax(dim, keepdim=True)
    if name == "int8":
        return amax / 127
    if name == "fp8":  # 3 mantissa bits: a step is at most 2^-3 of the value, or a subnormal step
        return torch.maximum(x.abs() * 2**-3, amax / 448 * 2**-9)
    return 2 * amax / 15  # int4 (affine over [min, max] per token or per channel group)


@pytest.mark.parametrize("name,side", [("int8", "k"), ("fp8", "k"), ("int4", "v"), ("int4", "k")])
def test_codec_round_trip_on_cuda_is_the_cpus_within_a_code(name: str, side: str) -> None:
    """Same codec on both devices: each value within one code step of the CPU's, and the GPU's
    round trip no worse than the CPU's (first run on an H200: 96 % of int8 values and 51 % of
    fp8 values bit-equal; torch's CUDA and CPU kernels round the scale's division differently)."""
    x = kv_like()
    codec = make_codec(name, side, 16)
    cpu, gpu = round_trip(codec, x), round_trip(codec, x.cuda()).cpu()
    assert gpu.device.type == "cpu" and gpu.shape == cpu.shape
    step = one_code(name, x, 1 if name == "int4" and side == "k" else -1)
    assert ((gpu - cpu).abs() <= step * 1.001 + 1e-6).all()
    assert (gpu - x).abs().mean() <= 1.01 * (cpu - x).abs().mean() + 1e-7


@pytest.mark.parametrize("kv", ["int8", "fp8", "int4"])
def test_engine_with_a_codec_pool_on_cuda_matches_the_cpu(tiny_llama: Path, kv: str) -> None:
    def run(device: str) -> list[list[int]]:
        llm = LLM(tiny_llama, dtype="float32", device=device, kv_cache_dtype=kv, block_size=4,
                  kv_cache_memory="2MiB", max_num_seqs=4)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        llm.engine.kv.check()
        llm.engine.runner.storage.check()
        assert llm.engine.kv.usage().used == 0
        return [o.outputs[0].token_ids for o in outs]

    assert run("cuda") == run("cpu")
