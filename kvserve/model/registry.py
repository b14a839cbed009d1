"""Architecture name (``config.json`` ``architectures[0]``) -> model class.

All supported architectures share one implementation (:class:`LlamaForCausalLM`); the config
carries their differences. Adding an architecture is one entry here plus its parity test.
"""

from __future__ import annotations

from kvserve.model.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    """Architecture names kvserve can run, sorted."""
    return sorted(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class for ``architecture``; raises ``ValueError`` naming the supported ones."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        ) from None
