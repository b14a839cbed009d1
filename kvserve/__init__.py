"""kvserve: a KV-cache-centred LLM inference server."""

from __future__ import annotations

# OpenMP's wait policy is left to the user (OMP_WAIT_POLICY) and otherwise to libgomp's default:
# workers spin a while after each parallel region, then sleep. Until session 11 importing kvserve
# set PASSIVE (workers sleep at once); a decode step makes ~170 parallel regions microseconds
# apart, and on a 2-core VM each wake-up of a halted core cost so much that steps took 1.6-1.9x
# longer than with the default (benchmarks/omp_wait.py). On an oversubscribed host PASSIVE wins
# instead (1.4-2.3x there): kvserve.engine.memory.omp_wait_note logs which applies at start-up.

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
