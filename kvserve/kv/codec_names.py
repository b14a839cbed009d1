"""KV codec names: the one parser and the one spelling, shared by the engine, the storage, the
planner and the server. Plain Python, no torch.

Canonical names: ``float32``, ``bfloat16``, ``float16`` (full precision), ``fp8`` (e4m3), ``int8``,
``int4``. Aliases (``bf16``, ``fp16``, ``half``, ``fp32``, ``e4m3`` …) are accepted on input; ``auto``
means the model's dtype. Keys and values may differ: ``k:int8,v:int4``; when both sides agree the
name is the single codec (``k:int8,v:int8`` is ``int8``), so equal storage always has one name.

Layers may differ too (a calibrated map, :mod:`kvserve.kv.calibration`): ``layers:`` then one pair
per layer, ``/``-separated, a run of equal layers written once with ``*n``:
``layers:int8*2/k:int8,v:int4/bfloat16``. A map whose layers all agree is that pair's name, so an
all-bf16 map *is* ``bfloat16`` (same storage, same prefix-cache identity).
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
    if is_layer_map(text):
        raise ValueError(f"KV dtype {spec!r} is a per-layer map; here one codec pair is needed "
                         f"(e.g. 'int8' or 'k:int8,v:int4')")
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


MAP_PREFIX = "layers:"


def is_layer_map(spec: str) -> bool:
    """True for a per-layer map spec (``layers:…``)."""
    return spec.strip().lower().startswith(MAP_PREFIX)


def map_name(layers: tuple[KVCodecSpec, ...] | list[KVCodecSpec]) -> str:
    """The canonical name of per-layer pairs: the single pair's name when all layers agree, else
    ``layers:`` + runs (``int8*2/k:int8,v:int4``). Parses back to the same pairs."""
    if not layers:
        raise ValueError("a per-layer KV map needs at least one layer")
    if all(x == layers[0] for x in layers):
        return layers[0].name
    runs: list[list[object]] = []
    for x in layers:
        if runs and runs[-1][0] == x:
            runs[-1][1] = int(runs[-1][1]) + 1  # type: ignore[call-overload]
        else:
            runs.append([x, 1])
    return MAP_PREFIX + "/".join(f"{x.name}*{n}" if n > 1 else x.name for x, n in runs)  # type: ignore[attr-defined]


def parse_layer_codecs(spec: str, model_dtype: str = "bfloat16", num_layers: int | None = None) -> tuple[KVCodecSpec, ...]:
    """Every layer's pair. A single spec (``int8``) applies to all ``num_layers`` layers (which
    must then be given); a map (``layers:…``) lists them and must have ``num_layers`` entries when
    that is given. Raises ValueError saying what to fix."""
    text = spec.strip().lower()
    if not is_layer_map(text):
        if num_layers is None:
            raise ValueError(f"KV dtype {spec!r} is one codec pair; the layer count is needed to expand it")
        return (parse_kv_codecs(text, model_dtype),) * num_layers
    out: list[KVCodecSpec] = []
    for part in text[len(MAP_PREFIX):].split("/"):
        name, star, count = part.strip().partition("*")
        if star and not (count.strip().isdigit() and int(count) > 0):
            raise ValueError(f"cannot read KV map entry {part!r} in {spec!r}; a run is '<codec>*<layers>', "
                             f"e.g. 'layers:int8*2/int4'")
        if not name.strip() or is_layer_map(name):
            raise ValueError(f"cannot read KV map {spec!r}; write 'layers:' then one codec pair per layer, "
                             f"'/'-separated (e.g. 'layers:int8*2/k:int8,v:int4')")
        out.extend([parse_kv_codecs(name, model_dtype)] * (int(count) if star else 1))
    if num_layers is not None and len(out) != num_layers:
        raise ValueError(f"KV map {spec!r} names {len(out)} layers but the model has {num_layers}")
    return tuple(out)


def resolve_kv_dtype(name: str, model_dtype: str = "bfloat16") -> str:
    """The canonical name of a KV dtype spec (``auto`` follows the model's dtype); a per-layer map
    is rewritten canonically (and collapses to one name when its layers agree)."""
    if is_layer_map(name):
        return map_name(parse_layer_codecs(name, model_dtype))
    return parse_kv_codecs(name, model_dtype).name


def kv_lossy(name: str, model_dtype: str = "bfloat16") -> bool:
    """True when any layer's K or V codec is lossy."""
    if is_layer_map(name):
        return any(x.lossy for x in parse_layer_codecs(name, model_dtype))
    return parse_kv_codecs(name, model_dtype).lossy


def split_kv_dtype(kv_dtype: str) -> tuple[str, str]:
    """A spec -> (key codec, value codec), canonical."""
    spec = parse_kv_codecs(kv_dtype)
    return spec.k, spec.v
