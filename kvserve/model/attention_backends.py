"""Attention backends, chosen by name.

A backend plans a step once (``plan``: from the step's metadata and a layer's KV shape, before
the forward) and attends each layer (``forward``: writes the new K/V, reads the context through
the block tables). The model never names a backend; the runner puts the chosen one and its plan
in :class:`~kvserve.model.attention.AttentionMetadata`. Adding one is one file and an entry here.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvserve.kv.layer_kv import LayerKV
from kvserve.model import attention


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: attention.AttentionMetadata, kv_shape: tuple[int, ...], device: torch.device) -> Any:
        """Per-step work shared by every layer (built once, before the forward)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKV,
                meta: attention.AttentionMetadata, scale: float) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, KVH, D]`` (rotated) -> ``[T, H, D]``; writes k/v first."""
        ...


class TorchSDPABackend:
    """Gathers each sequence's blocks and runs torch's ``scaled_dot_product_attention``
    (:mod:`kvserve.model.attention`); decodes of a step batched into one call."""

    name = "torch_sdpa"

    def plan(self, meta: attention.AttentionMetadata, kv_shape: tuple[int, ...], device: torch.device) -> Any:
        return attention.plan_step(meta, kv_shape, device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKV,
                meta: attention.AttentionMetadata, scale: float) -> torch.Tensor:
        return attention.paged_attention(q, k, v, kv_cache, meta, scale)


def _native() -> AttentionBackend:
    from kvserve.model.attention_native import NativePagedBackend

    return NativePagedBackend()


BACKENDS: dict[str, AttentionBackend] = {"torch_sdpa": TorchSDPABackend(), "native": _native()}
DEFAULT_BACKEND = "torch_sdpa"


def get_backend(name: str = DEFAULT_BACKEND) -> AttentionBackend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(BACKENDS))}") from None
