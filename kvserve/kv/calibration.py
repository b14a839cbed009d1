"""Precision per layer against a quality budget: the budget, the greedy choice, the cached result.

``kv_cache_dtype="auto"`` with ``kv_quality_budget="kl=1e-3"`` (or a ``kv_calibration`` file)
picks, per layer and per side (K, V), the smallest codec of bf16 (the model dtype) / fp8 / int8
/ int4 that keeps the whole model's KL within the budget. The measuring (the model on held-out
text, :mod:`kvserve.eval.calibrate`) is apart; this module is plain Python, no torch:

* :func:`parse_quality_budget` reads ``kl=<nats>`` (mean KL(p_full ‖ p_map) per scored token);
* :func:`greedy_moves` orders downgrades by bytes saved per KL added (each one's KL measured alone,
  the rest at full precision) and accepts them while the *summed* KL fits the budget; the caller
  then measures the map jointly and backs off the last moves until the joint KL fits;
* :class:`Calibration` is the result, written as JSON and read back (the cache and ``--kv-calibration``).

Invariant of a :class:`Calibration`: ``joint_kl <= budget_kl`` (measured on its text) and
``kv_dtype`` is the canonical map name of ``layers``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvserve.kv.codec_names import KVCodecSpec, map_name

DEFAULT_BUDGET_KL = 1e-3  # the gate for int8/fp8 (docs/kv-quant.md): about int8 everywhere on the shipped model
DEFAULT_BUDGET = f"kl={DEFAULT_BUDGET_KL:g}"
CANDIDATES: tuple[str, ...] = ("fp8", "int8", "int4")
FORMAT = 1


def parse_quality_budget(text: str | float | None) -> float:
    """``"kl=1e-3"`` (or ``"default"``, or a bare number) -> the KL budget in nats. Raises
    ValueError saying what to write."""
    if text is None or (isinstance(text, str) and text.strip().lower() == "default"):
        return DEFAULT_BUDGET_KL
    if isinstance(text, (int, float)):
        value, raw = float(text), str(text)
    else:
        raw = text.strip().lower()
        metric, sep, number = raw.partition("=")
        if sep and metric.strip() != "kl":
            raise ValueError(f"kv_quality_budget {text!r}: only 'kl' is measured; write e.g. 'kl=1e-3' "
                             f"(mean KL in nats per token against full-precision KV)")
        try:
            value = float(number if sep else raw)
        except ValueError:
            raise ValueError(f"cannot read kv_quality_budget {text!r}; write e.g. 'kl=1e-3' (mean KL in nats "
                             f"per token against full-precision KV), or 'default' ({DEFAULT_BUDGET})") from None
    if not 0 < value < math.inf:  # NaN fails too
        raise ValueError(f"kv_quality_budget {text!r} must be a KL > 0 nats and finite, e.g. 'kl=1e-3'")
    return value


# -- the greedy choice --------------------------------------------------------------------------

Choice = tuple[int, str]  # (layer, side "k" | "v")


@dataclass(frozen=True)
class Move:
    """Layer ``layer``'s side ``side`` goes from codec ``old`` to the smaller ``new``."""

    layer: int
    side: str
    old: str
    new: str
    saved: int      # bytes per block saved
    added: float    # KL added (each measured alone; may be <= 0 where the codec is as good)


def greedy_moves(num_layers: int, base: str, singles: Mapping[tuple[int, str, str], float],
                 side_bytes: Callable[[str, str], int], budget: float,
                 candidates: tuple[str, ...] = CANDIDATES) -> list[Move]:
    """Downgrades in the order accepted: at each step the move with the most bytes saved per KL
    added (from each (layer, side)'s current codec to any smaller one), taken when the summed KL
    stays <= ``budget``; a move that does not fit is dropped. ``singles[(layer, side, codec)]`` is
    the KL that codec adds alone (``base`` adds 0)."""
    current: dict[Choice, str] = {(layer, s): base for layer in range(num_layers) for s in ("k", "v")}
    kl = {(layer, s, c): max(0.0, singles.get((layer, s, c), 0.0)) for layer, s in current
          for c in (base, *candidates)}
    for layer, s in current:
        kl[(layer, s, base)] = 0.0
    dropped: set[tuple[int, str, str]] = set()
    total, moves = 0.0, []
    while True:
        best: tuple[float, Move] | None = None
        for (layer, s), old in current.items():
            for new in candidates:
                saved = side_bytes(old, s) - side_bytes(new, s)
                if saved <= 0 or (layer, s, new) in dropped:
                    continue
                added = kl[(layer, s, new)] - kl[(layer, s, old)]
                score = saved / max(added, 1e-12)
                if best is None or score > best[0]:
                    best = (score, Move(layer, s, old, new, saved, added))
        if best is None:
            return moves
        move = best[1]
        if total + max(move.added, 0.0) <= budget:
            total += max(move.added, 0.0)
            current[(move.layer, move.side)] = move.new
            moves.append(move)
        else:
            dropped.add((move.layer, move.side, move.new))


def apply_moves(num_layers: int, base: str, moves: list[Move]) -> tuple[KVCodecSpec, ...]:
    """The per-layer pairs after ``moves`` (each layer starts at ``base`` on both sides)."""
    sides = {(layer, s): base for layer in range(num_layers) for s in ("k", "v")}
    for m in moves:
        sides[(m.layer, m.side)] = m.new
    return tuple(KVCodecSpec(sides[(layer, "k")], sides[(layer, "v")]) for layer in range(num_layers))


# -- the result --------------------------------------------------------------------------------

@dataclass
class Calibration:
    """A chosen map and how it was found (see the module's invariant)."""

    kv_dtype: str                       # canonical: ``layers:…`` or one pair's name
    layers: list[dict[str, str]]        # [{"k": codec, "v": codec}] per layer
    budget_kl: float
    joint_kl: float                     # measured with the whole map at once
    summed_kl: float                    # the estimate the greedy pass used
    bytes_per_token: int
    full_bytes_per_token: int           # the model dtype on every layer
    model: str
    model_id: str
    text: dict[str, object]             # what it was measured on: texts, tokens, chunk, sha256
    settings: dict[str, object]         # block_size, group_size, sink_tokens
    singles: dict[str, float] = field(default_factory=dict)  # "layer/side/codec" -> KL alone
    measured: int = 0                   # forward passes of the held-out text it took
    seconds: float = 0.0
    source: str = ""                    # where it came from this start (not saved)
    format: int = FORMAT

    @classmethod
    def make(cls, pairs: tuple[KVCodecSpec, ...], **kw: object) -> Calibration:
        return cls(kv_dtype=map_name(pairs), layers=[{"k": p.k, "v": p.v} for p in pairs], **kw)  # type: ignore[arg-type]

    @property
    def pairs(self) -> tuple[KVCodecSpec, ...]:
        return tuple(KVCodecSpec(x["k"], x["v"]) for x in self.layers)

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out.pop("source")
        return out

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read a calibration file. Raises ValueError naming the file when it is not one."""
        try:
            doc = json.loads(Path(path).read_text())
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT}")
            out = cls(**{k: v for k, v in doc.items() if k in cls.__dataclass_fields__})
            if map_name(out.pairs) != out.kv_dtype:
                raise ValueError("its kv_dtype does not match its layers")
        except (OSError, TypeError, KeyError, AttributeError, json.JSONDecodeError, ValueError) as e:
            raise ValueError(f"cannot read KV calibration file {str(path)!r}: {e}") from None
        out.source = str(path)
        return out

    @property
    def gain(self) -> float:
        """Tokens per byte against the model dtype on every layer."""
        return self.full_bytes_per_token / self.bytes_per_token

    def describe(self) -> str:
        """One line per layer: ``layer 0: K int8 V int4``."""
        return "\n".join(f"  layer {i}: K {x['k']:<8} V {x['v']}" for i, x in enumerate(self.layers))
