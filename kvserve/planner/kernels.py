"""``kvserve plan --hardware cpu``: the kernels this host runs the planned model's shape on.

The GEMM path per role and row band comes from :func:`kvserve.model.gemm_plan.plan_for` on the
model's shape, and the attention backend per band from
:func:`kvserve.model.attention_choice.select_backend` (the engine's own ``auto`` choice, same cache) (synthetic weights, so a model the planner only knows from its config is measured
too; ~2 s for a 0.5B shape the first time, then the cached figures). MLA and MoE models, whose
matrices the engine does not run, get none. Plain rows for the text, markdown and JSON reports.
"""

from __future__ import annotations

from kvserve.planner.model_spec import ModelSpec


def cpu_kernel_rows(spec: ModelSpec, weight_dtype: str,
                    block_size: int = 16) -> tuple[tuple[str, str, str, str], ...]:
    """``(role, band, choice, source)`` per GEMM role and band, then per attention band; none for
    MLA/MoE shapes or non-float weights."""
    import torch

    from kvserve.model.gemm_paths import BANDS
    from kvserve.model.gemm_plan import plan_for
    from kvserve.model.gemm_tune import role_shapes

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(weight_dtype)
    if spec.mla is not None or spec.moe is not None or dtype is None:
        return ()
    roles = role_shapes(spec.hidden_size, spec.intermediate_size, spec.num_attention_heads * spec.head_dim,
                        spec.num_kv_heads * spec.head_dim, spec.vocab_size, spec.num_layers)
    plan = plan_for(roles, dtype)
    gemm = tuple((f"gemm_{role}", band, path, plan.source)
                 for role, bands in plan.paths.items() for band, path in zip(BANDS, bands))
    return gemm + attention_rows(spec, dtype, block_size) + target_rows()


def target_rows() -> tuple[tuple[str, str, str, str], ...]:
    """The native kernels' build target (``KVSERVE_NATIVE_MARCH`` or this CPU) and its
    instruction sets; none where no native kernel was built."""
    from kvserve.native.choices import choices

    return tuple((c.role, c.band, c.choice, c.source) for c in choices() if c.role == "native_target")


def attention_rows(spec: ModelSpec, dtype: object, block_size: int) -> tuple[tuple[str, str, str, str], ...]:
    """What ``--attention-backend auto`` picks per band for this shape (builds the native kernel
    on first use; the torch path where it cannot be built)."""
    from kvserve.model.attention_choice import select_backend
    from kvserve.native.choices import choices

    select_backend("auto", heads=spec.num_attention_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                   block_size=block_size, dtype=dtype)  # type: ignore[arg-type]
    return tuple((c.role, c.band, c.choice, c.source) for c in choices() if c.role.startswith("attention_"))
