"""``--write-config FILE``: turn a plan into the config file the engine reads.

The KV budget is written as a fixed ``cache.kv_cache_memory`` (bytes), so the engine sizes exactly
the pool the plan printed (``capacity_for_budget`` on both sides). The KV dtype is written resolved
(``bfloat16``, ``int8`` …), never ``auto``.
"""

from __future__ import annotations

from pathlib import Path

from kvserve.config import SUPPORTED_ARCHITECTURES, CacheConfig, EngineConfig, SchedulerConfig
from kvserve.config_file import DeploymentExtras
from kvserve.planner.plan import Plan
from kvserve.planner.presets import model_presets


def _model_location(plan: Plan) -> str:
    kind, _, where = plan.spec.source.partition(" ")
    if kind == "preset":
        return str(model_presets()[plan.spec.name]["hf_repo"])
    return str(Path(where).resolve().parent)  # the folder holding config.json


def engine_config_for(plan: Plan) -> tuple[EngineConfig, DeploymentExtras]:
    """The engine config and extras for ``plan``; ``ValueError`` when the engine cannot run it."""
    s = plan.settings
    if plan.spec.engine_config is None:
        raise ValueError(
            f"--write-config: the kvserve engine does not run {plan.spec.architecture}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if s.weight_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(
            f"--write-config: the engine loads float32, bfloat16 or float16 weights, not {s.weight_dtype}"
        )
    if s.tp != 1:
        raise ValueError(f"--write-config: the engine runs on one device; plan with --tp 1 (got {s.tp})")
    engine = EngineConfig(
        model=_model_location(plan),
        dtype=s.weight_dtype,
        cache=CacheConfig(
            block_size=s.block_size,
            kv_cache_memory=plan.ledger.kv_budget_bytes,
            kv_cache_dtype=s.kv_dtype,
            enable_prefix_caching=s.prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=s.max_model_len,
        ),
    )
    extras = DeploymentExtras(
        session_idle_timeout_s=s.session_idle_timeout_s,
        sliding_window=s.sliding_window,
        reserve_bytes=plan.ledger.reserve_bytes,
        utilization=s.utilization,
        tensor_parallel=s.tp,
        hardware=plan.hardware.key or plan.hardware.name if plan.hardware else None,
        scenario=s.scenario,
    )
    return engine, extras
