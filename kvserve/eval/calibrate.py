"""Calibrate a per-layer KV map on held-out text: measure, choose (:mod:`kvserve.kv.calibration`), cache.

One engine holds the model (full-precision KV, prefix caching off); each candidate map gets a fresh
:class:`~kvserve.kv.storage.KVStorage` swapped into its runner, and the held-out sequences are
scored teacher-forced through the engine's paged path (as ``kvserve eval kv`` does), ``chunk``
tokens per step, quantized from the first token (``kv_quant_min_tokens`` is ignored: the worst
case). KL is the mean over scored positions of KL(p_full ‖ p_map), in nats.

Steps: (1) each (layer, side, codec) alone, the rest at full precision: ``layers × 2 × 3`` passes;
(2) :func:`~kvserve.kv.calibration.greedy_moves` within the budget on the summed KL; (3) the map
measured jointly, backing off the last accepted move while the joint KL exceeds the budget. The
result is cached as JSON under ``kvserve.native.cache_dir()/kv-calibration/``, keyed by the
model's identity hash, the budget, the text (its token ids' sha256) and the codec settings; a
``kv_calibration`` path is read when it exists and written when it does not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.kv.calibration import CANDIDATES, Calibration, apply_moves, greedy_moves, parse_quality_budget
from kvserve.kv.codec_names import KVCodecSpec, map_name, parse_layer_codecs
from kvserve.kv.hashing import model_identity
from kvserve.kv.layout import int4_group_size, model_kv_bytes_per_token, side_block_bytes, window_blocks
from kvserve.kv.storage import KVStorage

log = logging.getLogger("kvserve")


@dataclass(frozen=True)
class CalibrationText:
    """What the map is measured on: ``texts`` held-out texts of the shipped chat model's data set,
    their first ``max_tokens`` tokens each, fed ``chunk`` tokens per step."""

    texts: int = 4
    max_tokens: int = 256
    chunk: int = 16


class Calibrator:
    """Scores maps on fixed sequences against the full-precision reference (memoized by map name)."""

    def __init__(self, config: EngineConfig, sequences: Sequence[list[int]], chunk: int) -> None:
        from kvserve.engine.engine import LLMEngine
        from kvserve.eval.kv_quality import _Scored, teacher_forced_logprobs

        self._scored, self._forced = _Scored, teacher_forced_logprobs
        self.engine = LLMEngine(config)
        self.sequences = [s for s in sequences if len(s) >= 2]
        if not self.sequences:
            raise ValueError("KV calibration needs held-out text of at least 2 tokens")
        self.chunk = chunk
        self.targets = [torch.tensor(s[1:]) for s in self.sequences]
        self.ref = self._score()
        self.cache: dict[str, float] = {}
        self.measured = 1

    def _score(self) -> object:
        return self._scored(self._forced(self.engine, self.sequences, self.chunk), self.targets)

    def kl(self, pairs: tuple[KVCodecSpec, ...]) -> float:
        """Mean KL(p_full ‖ p_map) over every predicting position (nats)."""
        from kvserve.eval.kv_quality import compare

        name = map_name(pairs)
        if name not in self.cache:
            runner = self.engine.runner
            keep = runner.storage
            runner.storage = self._storage(name)
            try:
                self.cache[name] = compare(self.ref, self._score())[0]  # type: ignore[arg-type]
            finally:
                runner.storage = keep
            self.measured += 1
        return self.cache[name]

    def _storage(self, name: str) -> KVStorage:
        e, mc, cache = self.engine, self.engine.model_config, self.engine.config.cache
        bs = e.capacity.block_size
        return KVStorage(num_layers=mc.num_hidden_layers, num_blocks=e.capacity.num_blocks, block_size=bs,
                         kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim, dtype=e.runner.storage.dtype,
                         pool=parse_layer_codecs(name, mc.dtype, mc.num_hidden_layers),
                         group_size=int4_group_size(bs, cache.kv_quant_group_size),
                         window_blocks=window_blocks(name, bs, len(self.sequences), 0, cache.kv_quant_sink_tokens),
                         min_tokens=0, sink_tokens=cache.kv_quant_sink_tokens, device=e.runner.device)


def calibrate(calibrator: Calibrator, budget: float, model: ModelConfig, cache: CacheConfig) -> Calibration:
    """Choose the map for ``budget`` (measuring what ``calibrator`` has not measured yet)."""
    t0 = time.perf_counter()
    layers, base = model.num_hidden_layers, model.dtype
    bs = cache.block_size
    group = int4_group_size(bs, cache.kv_quant_group_size)

    def side_bytes(codec: str, side: str) -> int:
        return side_block_bytes(codec, side, bs, model.num_key_value_heads, model.head_dim, group)

    full = (KVCodecSpec(base, base),) * layers
    singles: dict[tuple[int, str, str], float] = {}
    for layer in range(layers):
        for side in ("k", "v"):
            for codec in CANDIDATES:
                pairs = list(full)
                k, v = (codec, base) if side == "k" else (base, codec)
                pairs[layer] = KVCodecSpec(k, v)
                singles[(layer, side, codec)] = calibrator.kl(tuple(pairs))
    moves = greedy_moves(layers, base, singles, side_bytes, budget)
    summed = sum(max(m.added, 0.0) for m in moves)
    pairs = apply_moves(layers, base, moves)
    joint = calibrator.kl(pairs)
    while joint > budget and moves:  # not additive after all: give back the last (least efficient) moves
        moves.pop()
        summed = sum(max(m.added, 0.0) for m in moves)
        pairs = apply_moves(layers, base, moves)
        joint = calibrator.kl(pairs)
    name = map_name(pairs)
    return Calibration.make(
        pairs, budget_kl=budget, joint_kl=joint, summed_kl=summed,
        bytes_per_token=model_kv_bytes_per_token(model, name, bs, cache.kv_quant_group_size),
        full_bytes_per_token=model_kv_bytes_per_token(model, base, bs, cache.kv_quant_group_size),
        model=str(calibrator.engine.config.model), model_id="", text={}, settings={},
        singles={f"{la}/{s}/{c}": v for (la, s, c), v in singles.items()}, measured=calibrator.measured,
        seconds=time.perf_counter() - t0)


def calibration_config(config: EngineConfig, text: CalibrationText, full_bytes_per_token: int) -> EngineConfig:
    """The measuring engine: full-precision KV, no prefix cache, in this process, sized for the text."""
    c = config.cache
    need = 2 * text.texts * (text.max_tokens + c.block_size) * full_bytes_per_token + 16 * 2**20
    cache = CacheConfig(block_size=c.block_size, kv_cache_memory=need, enable_prefix_caching=False,
                        kv_quant_group_size=c.kv_quant_group_size, kv_quant_sink_tokens=c.kv_quant_sink_tokens)
    sched = SchedulerConfig(max_num_seqs=text.texts, max_num_batched_tokens=max(512, text.texts * text.chunk),
                            max_model_len=text.max_tokens + c.block_size)
    return EngineConfig(model=config.model, dtype=config.dtype, device=config.device, cache=cache, scheduler=sched,
                        num_threads=config.num_threads, seed=config.seed)


def heldout_sequences(tokenizer: object, text: CalibrationText) -> list[list[int]]:
    from kvserve.eval.kv_quality import heldout_tokens

    return heldout_tokens(tokenizer, text.texts, text.max_tokens)


def cache_path(key: dict[str, object]) -> Path:
    from kvserve.native import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "kv-calibration" / f"{digest}.json"


def resolve_calibration(config: EngineConfig, model: ModelConfig, tokenizer: object,
                        text: CalibrationText = CalibrationText()) -> Calibration:
    """The engine's map for ``kv_cache_dtype="auto"`` with a budget or a calibration file: the
    file when it exists (checked against the model), else the cache when it holds this key, else
    a fresh calibration (written to the file, or the cache). Raises ValueError saying what to fix."""
    c = config.cache
    budget = parse_quality_budget(c.kv_quality_budget)
    model_id = model_identity(config.model)
    file = Path(c.kv_calibration).expanduser() if c.kv_calibration else None
    if file is not None and file.exists():
        cal = Calibration.load(file)
        _check_fits(cal, model, model_id, c, file)
        return cal
    sequences = heldout_sequences(tokenizer, text)
    settings = {"block_size": c.block_size, "group_size": int4_group_size(c.block_size, c.kv_quant_group_size),
                "sink_tokens": c.kv_quant_sink_tokens, "dtype": model.dtype}
    text_doc = {"texts": text.texts, "max_tokens": text.max_tokens, "chunk": text.chunk, "tokens": sum(map(len, sequences)),
                "sha256": hashlib.sha256(json.dumps(sequences).encode()).hexdigest()}
    key = {"model_id": model_id, "budget_kl": budget, "text": text_doc, "settings": settings}
    cached = cache_path(key)
    if file is None and cached.exists():
        try:
            cal = Calibration.load(cached)
            cal.source = f"cache {cached}"
            return cal
        except ValueError as e:
            log.warning("%s; calibrating again", e)
    full_bpt = model_kv_bytes_per_token(model, model.dtype, c.block_size, c.kv_quant_group_size)
    log.info("KV calibration: measuring %d layers × K/V × %s on %d held-out tokens (budget kl=%g)",
             model.num_hidden_layers, "/".join(CANDIDATES), text_doc["tokens"], budget)
    calibrator = Calibrator(calibration_config(config, text, full_bpt), sequences, text.chunk)
    cal = calibrate(calibrator, budget, model, c)
    cal.model_id, cal.text, cal.settings = model_id, text_doc, settings
    target = file or cached
    cal.save(target)
    cal.source = f"calibrated in {cal.seconds:.1f} s, saved to {target}"
    return cal


def _check_fits(cal: Calibration, model: ModelConfig, model_id: str, cache: CacheConfig, path: Path) -> None:
    if len(cal.layers) != model.num_hidden_layers:
        raise ValueError(f"KV calibration file {str(path)!r} has {len(cal.layers)} layers but the model has "
                         f"{model.num_hidden_layers}; calibrate this model (delete the file)")
    if cal.model_id and cal.model_id != model_id:
        raise ValueError(f"KV calibration file {str(path)!r} was made for another checkpoint "
                         f"({cal.model}); delete it to calibrate this one, or pass another file")
    if cache.kv_quality_budget is not None and parse_quality_budget(cache.kv_quality_budget) != cal.budget_kl:
        raise ValueError(f"KV calibration file {str(path)!r} was calibrated for kl={cal.budget_kl:g}, not "
                         f"{cache.kv_quality_budget}; drop kv_quality_budget or use another file")
