"""Owns the model and the KV storage tensors; runs one scheduled step.

KV storage: one tensor per layer, ``[2, num_blocks, block_size, kv_heads, head_dim]``. Its byte
size equals ``KVCapacity.allocated_bytes`` (checked at start-up), so what the engine reports is
what it holds.
"""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.kv.layout import KVCapacity
from kvserve.model.llama import LlamaForCausalLM
from kvserve.runner.inputs import build_inputs
from kvserve.runner.sampler import SampleResult, Sampler
from kvserve.scheduler.output import SchedulerOutput

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, capacity: KVCapacity,
                 kv_dtype: str, device: torch.device, seed: int = 0) -> None:
        self.model = model
        self.config = model_config
        self.capacity = capacity
        self.device = device
        self.sampler = Sampler(seed)
        shape = (2, capacity.num_blocks, capacity.block_size, model_config.num_key_value_heads,
                 model_config.head_dim)
        # torch.empty: pages are only touched when written, and attention reads written slots only.
        self.kv_caches = [torch.empty(shape, dtype=torch_dtype(kv_dtype), device=device)
                          for _ in range(model_config.num_hidden_layers)]
        held = sum(t.numel() * t.element_size() for t in self.kv_caches)
        if held != capacity.allocated_bytes:
            raise RuntimeError(f"KV storage holds {held} bytes but capacity says {capacity.allocated_bytes}")

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        """Run the model over every scheduled chunk; sample where a chunk reached its end."""
        for src, dst in out.block_copies:  # copy-on-write of shared blocks this step writes
            for cache in self.kv_caches:
                cache[:, dst].copy_(cache[:, src])
        inputs = build_inputs(out.chunks, self.capacity.block_size, self.config.sliding_window, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sample_requests:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        results = self.sampler.sample(logits, inputs.sample_requests)
        return {req.request_id: r for req, r in zip(inputs.sample_requests, results)}
