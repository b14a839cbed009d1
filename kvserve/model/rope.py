"""Rotary position embeddings, bit-for-bit like Hugging Face transformers.

``inv_freq`` is computed once, in float32, the way transformers' rope-init functions do
(``default``, ``linear`` and ``llama3`` kinds). Each step computes ``cos``/``sin`` for that step's
positions only (``[T, head_dim]``, ``emb = cat(freqs, freqs)``), then casts them to the model dtype;
layers apply them with the ``rotate_half`` convention (first half / second half of the head, not
interleaved pairs).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.config import ModelConfig


def compute_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 on CPU, scaled per ``config.rope_scaling``.

    Mirrors transformers' ``_compute_default/linear_scaling/llama3_parameters`` (same float32
    expression order, so values are identical).
    """
    dim = config.head_dim
    base = config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim
    inv_freq = 1.0 / (base ** exponents)
    scaling = config.rope_scaling
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_scale(inv_freq, config)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, a smooth
    interpolation in between (wavelength thresholds set by the original context length)."""
    s = config.rope_scaling
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    old_context_len = s.original_max_position_embeddings or config.max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """Holds ``inv_freq`` (a non-persistent float32 buffer) and turns positions into cos/sin.

    ``inv_freq`` is always built on the CPU (explicit device), even under a ``torch.device("meta")``
    context, so a model constructed on the meta device by the loader still has real frequencies.
    """

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", compute_inv_freq(config), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` int64 -> ``(cos, sin)`` each ``[T, head_dim]`` in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, head_dim/2] float32
        emb = torch.cat((freqs, freqs), dim=-1)                      # [T, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` -> ``[..., d]`` with halves (x1, x2) mapped to (-x2, x1)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, d]`` by ``cos/sin [T, d]`` (broadcast over heads)."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return x * cos + rotate_half(x) * sin
