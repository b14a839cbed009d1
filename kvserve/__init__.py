"""kvserve: a KV-cache-centred LLM inference server."""

from __future__ import annotations

import os

# OpenMP threads that spin after each parallel region steal the cores the GEMM shard threads
# (kvserve.model.cpu_gemm) and other processes need; sleeping workers were as fast or faster in
# every CPU measurement here. Only takes effect when torch is not imported yet; a user's own
# setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    # Lazy: `import kvserve` stays light (the planner needs no torch).
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
