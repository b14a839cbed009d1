"""Owns the model and the KV storage; runs one scheduled step.

KV storage (:class:`kvserve.kv.storage.KVStorage`): for a float KV dtype, one tensor per layer
``[2, num_blocks, block_size, kv_heads, head_dim]``; for a lossy codec (fp8, int8, int4) one byte
tensor per layer holding each block's codec fields, plus the full-precision window. Its byte size
equals ``KVCapacity.allocated_bytes`` (checked at start-up), so what the engine reports is what it
holds.
"""

from __future__ import annotations

import torch

from kvserve.config import CacheConfig, ModelConfig
from kvserve.kv.layout import KVCapacity, int4_group_size
from kvserve.kv.quant import parse_kv_codecs
from kvserve.kv.storage import KVStorage
from kvserve.model.llama import LlamaForCausalLM
from kvserve.runner.inputs import ModelInputs, build_inputs
from kvserve.runner.sampler import Sampler, SampleResult
from kvserve.scheduler.output import SchedulerOutput

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, capacity: KVCapacity,
                 kv_dtype: str, device: torch.device, seed: int = 0, cache: CacheConfig | None = None) -> None:
        self.model = model
        self.config = model_config
        self.capacity = capacity
        self.device = device
        self.sampler = Sampler(seed)
        cache = cache or CacheConfig(block_size=capacity.block_size)
        # torch.empty inside: pages are only touched when written, and reads see written slots only.
        self.storage = KVStorage(
            num_layers=model_config.num_hidden_layers, num_blocks=capacity.num_blocks,
            block_size=capacity.block_size, kv_heads=model_config.num_key_value_heads,
            head_dim=model_config.head_dim, dtype=torch_dtype(model_config.dtype),
            pool=parse_kv_codecs(kv_dtype, model_config.dtype),
            group_size=int4_group_size(capacity.block_size, cache.kv_quant_group_size),
            window_blocks=capacity.window_blocks, min_tokens=cache.kv_quant_min_tokens,
            sink_tokens=cache.kv_quant_sink_tokens, device=device,
        )
        if self.storage.nbytes != capacity.allocated_bytes:
            raise RuntimeError(f"KV storage holds {self.storage.nbytes} bytes but capacity says "
                               f"{capacity.allocated_bytes}")

    @property
    def kv_bytes(self) -> int:
        return self.storage.nbytes

    def forward(self, out: SchedulerOutput) -> tuple[torch.Tensor, ModelInputs]:
        """One forward over every scheduled chunk: final hidden states ``[T, hidden]`` and the inputs."""
        self.storage.begin_step(out.chunks, out.block_copies)  # copy-on-write copies happen here
        try:
            inputs = build_inputs(out.chunks, self.capacity.block_size, self.config.sliding_window, self.device)
            hidden = self.model(inputs.input_ids, inputs.positions, self.storage.layers(), inputs.meta)
        finally:
            self.storage.end_step()
        return hidden, inputs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        """Run the model over every scheduled chunk; sample where a chunk reached its end."""
        hidden, inputs = self.forward(out)
        if not inputs.sample_requests:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        results = self.sampler.sample(logits, inputs.sample_requests)
        return {req.request_id: r for req, r in zip(inputs.sample_requests, results)}

    @torch.inference_mode()
    def score(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits ``[T, vocab]`` (float32) of every scheduled token: teacher-forced evaluation."""
        hidden, _ = self.forward(out)
        return self.model.compute_logits(hidden)
