"""kvserve: a KV-cache-centred LLM inference server."""

from __future__ import annotations

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
