"""KV codec names: the one parser and the one spelling, shared by the engine, the storage, the
planner and the server. Plain Python, no torch.

Canonical names: ``float32``, ``bfloat16``, ``float16`` (full precision), ``fp8`` (e4m3), ``int8``,
``int4``. Aliases (``bf16``, ``fp16``, ``half``, ``fp32``, ``e4m3`` …) are accepted on input; ``auto``
means the model's dtype. Keys and values may differ: ``k:int8,v:int4``; when both sides agree the
name is the single codec (``k:int8,v:int8`` is ``int8``), so equal storage always has one name.
"""

from __future__ import annotations

from dataclasses import dataclass

CODEC_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16", "fp8", "int8", "int4")
FLOAT_CODECS: tuple[str, ...] = ("float32", "bfloat16", "float16")
ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
           "e4m3": "fp8", "fp8_e4m3": "fp8"}


def canonical_codec_name(name: str, model_dtype: str = "bfloat16", whole: str | None = None) -> str:
    """One side's canonical name. Unknown names list the valid ones."""
    key = name.strip().lower()
    if key == "auto":
        key = model_dtype
    key = ALIASES.get(key, key)
    if key not in CODEC_NAMES:
        raise ValueError(f"unknown KV dtype {whole or name!r}; valid: auto, {', '.join(sorted(CODEC_NAMES))} "
                         f"(or 'k:<dtype>,v:<dtype>' for different key and value codecs)")
    return key


@dataclass(frozen=True)
class KVCodecSpec:
    """The codecs of the key side and the value side (canonical names), e.g. ``k:int8,v:int4``."""

    k: str
    v: str

    def __post_init__(self) -> None:
        for name in (self.k, self.v):
            if name not in CODEC_NAMES:
                raise ValueError(f"unknown KV codec {name!r}; valid: {', '.join(CODEC_NAMES)}")

    @property
    def name(self) -> str:
        """``int8`` when both sides agree, else ``k:int8,v:int4`` (parses back to the same spec)."""
        return self.k if self.k == self.v else f"k:{self.k},v:{self.v}"

    @property
    def lossy(self) -> bool:
        return self.k not in FLOAT_CODECS or self.v not in FLOAT_CODECS


def parse_kv_codecs(spec: str, model_dtype: str = "bfloat16") -> KVCodecSpec:
    """``"int8"`` (both sides), ``"k:int8,v:int4"`` or ``"auto"`` (the model dtype).
    Raises ValueError naming the valid codecs for an unknown name or a malformed spec."""
    text = spec.strip().lower()
    if ":" not in text:
        name = canonical_codec_name(text, model_dtype, spec)
        return KVCodecSpec(name, name)
    sides: dict[str, str] = {}
    for part in text.split(","):
        side, sep, name = part.partition(":")
        side = side.strip()
        if not sep or side not in ("k", "v") or side in sides:
            raise ValueError(f"cannot read KV dtype {spec!r}; write one dtype ('int8') or both sides "
                             f"once each ('k:int8,v:int4')")
        sides[side] = canonical_codec_name(name, model_dtype, spec)
    if set(sides) != {"k", "v"}:
        raise ValueError(f"KV dtype {spec!r} must name both sides: 'k:<dtype>,v:<dtype>'")
    return KVCodecSpec(sides["k"], sides["v"])


def resolve_kv_dtype(name: str, model_dtype: str = "bfloat16") -> str:
    """The canonical name of a KV dtype spec (``auto`` follows the model's dtype)."""
    return parse_kv_codecs(name, model_dtype).name


def split_kv_dtype(kv_dtype: str) -> tuple[str, str]:
    """A spec -> (key codec, value codec), canonical."""
    spec = parse_kv_codecs(kv_dtype)
    return spec.k, spec.v
