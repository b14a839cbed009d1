"""The turn-by-turn experiment: does a chat get slower every turn?

A conversation of T turns; each turn adds ``user_tokens`` new tokens and generates
``new_tokens``. Per turn we record time to first token, ms per output token, prompt tokens
computed and taken from cache, KV held and process RSS. Modes:

* ``none``     whole history resent each turn, prefix cache off: everything is recomputed;
* ``prefix``   whole history resent, prefix cache on: the history's full blocks are hits;
* ``session``  only the new tokens are sent; the session's KV stays pinned between turns (and is
  recomputed when the pool had to release it);
* ``session-tiers``  ``session`` with host + disk tiers below the same pool: KV that left the pool
  is loaded back; afterwards a new engine is started on the same disk directory and the next turn
  of every conversation is timed (restart to first token, index rebuild);
* ``session-big``  ``session`` with a pool of ``big_kv_cache_memory`` that holds everything (the
  reference the tiers are measured against);
* ``hf-recompute`` / ``hf-reuse``  transformers as the outside reference (see ``hf_reference``).

With ``conversations=K`` the K conversations take their turns round-robin, so their caches compete.
"""

from __future__ import annotations

import gc
import random
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import psutil
import torch

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

ENGINE_MODES = ("none", "prefix", "session", "session-tiers", "session-big")
HF_MODES = ("hf-recompute", "hf-reuse")
ALL_MODES = ENGINE_MODES + HF_MODES


@dataclass(frozen=True)
class TurnsConfig:
    model: str
    modes: tuple[str, ...] = ("none", "prefix", "session")
    turns: int = 40
    user_tokens: int = 64
    new_tokens: int = 32
    conversations: int = 1
    dtype: str = "auto"
    kv_cache_memory: str = "1GiB"
    seed: int = 0
    kv_host_memory: str = "4GiB"      # session-tiers: the host tier
    kv_disk_dir: str | None = None    # session-tiers: the disk tier (None: a temporary directory)
    big_kv_cache_memory: str = "8GiB"  # session-big: a pool that holds every conversation
    attention_backend: str = "auto"    # kvserve.model.attention_choice: auto, torch_sdpa, native

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in ALL_MODES]
        if unknown:
            raise ValueError(f"unknown mode(s) {unknown}; valid: {', '.join(ALL_MODES)}")
        for name in ("turns", "user_tokens", "new_tokens", "conversations"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class TurnRecord:
    turn: int
    conversation: int
    ttft_s: float
    ms_per_token: float
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    kv_blocks: int | None
    kv_bytes: int
    rss_bytes: int


def user_turn_tokens(cfg: TurnsConfig, conversation: int, turn: int, vocab: int) -> list[int]:
    """Deterministic synthetic user tokens (ids 10…vocab-1, avoiding specials at the bottom)."""
    rng = random.Random(hash((cfg.seed, conversation, turn)) & 0xFFFFFFFF)
    return [rng.randrange(10, vocab) for _ in range(cfg.user_tokens)]


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _engine(cfg: TurnsConfig, mode: str, disk_dir: str | None) -> LLM:
    tiers = {"kv_host_memory": cfg.kv_host_memory, "kv_disk_dir": disk_dir} if mode == "session-tiers" else {}
    return LLM(cfg.model, dtype=cfg.dtype,
               kv_cache_memory=cfg.big_kv_cache_memory if mode == "session-big" else cfg.kv_cache_memory,
               enable_prefix_caching=mode != "none", max_num_batched_tokens=4096,
               max_model_len=(cfg.turns + 1) * (cfg.user_tokens + cfg.new_tokens) + 16,
               attention_backend=cfg.attention_backend, **tiers)  # type: ignore[arg-type]


def run_engine_mode(cfg: TurnsConfig, mode: str, progress: Callable[[int], None] | None = None,
                    restart: dict | None = None) -> list[TurnRecord]:
    """One mode's turns. For ``session-tiers`` with ``restart`` given, also the restart figures."""
    with tempfile.TemporaryDirectory() as tmp:
        disk = (cfg.kv_disk_dir or tmp) if mode == "session-tiers" else None
        llm = _engine(cfg, mode, disk)
        records = _turns(cfg, mode, llm, range(1, cfg.turns + 1), progress)
        del llm
        gc.collect()
        if mode == "session-tiers" and restart is not None:
            t0 = time.perf_counter()
            again = _engine(cfg, mode, disk)  # sessions and the disk index come back from the directory
            start_s = time.perf_counter() - t0
            tier = again.engine.runner.tiers.tiers[-1]
            after = _turns(cfg, mode, again, [cfg.turns + 1], None)
            restart.update(engine_start_s=start_s, disk_blocks=tier.rebuilt, index_rebuild_s=tier.rebuild_seconds,
                           rebuild_s_per_10k_blocks=tier.rebuild_seconds / max(1, tier.rebuilt) * 10_000,
                           first_token_after_restart_s=start_s + after[0].ttft_s,
                           next_turn_ttft_median_s=_median([r.ttft_s for r in after]),
                           next_turn_cached_fraction=sum(r.cached_tokens for r in after)
                           / max(1, sum(r.prompt_tokens - cfg.user_tokens for r in after)))
            del again
            gc.collect()
    return records


def _turns(cfg: TurnsConfig, mode: str, llm: LLM, turns: Iterable[int],
           progress: Callable[[int], None] | None) -> list[TurnRecord]:
    engine = llm.engine
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    params = SamplingParams(max_tokens=cfg.new_tokens, temperature=0, ignore_eos=True)
    histories: list[list[int]] = [[] for _ in range(cfg.conversations)]
    records: list[TurnRecord] = []
    bpt = engine.capacity.bytes_per_token
    for t in turns:
        for c in range(cfg.conversations):
            new = user_turn_tokens(cfg, c, t, vocab)
            if mode.startswith("session"):
                rid = engine.add_request({"prompt_token_ids": new}, params, session_id=f"conv-{c}")
            else:
                rid = engine.add_request({"prompt_token_ids": histories[c] + new}, params)
            out, ttft, per_tok = _drive(engine, rid)
            histories[c] = out.prompt_token_ids + out.outputs[0].token_ids
            usage = engine.kv.usage()
            records.append(TurnRecord(
                turn=t, conversation=c, ttft_s=ttft, ms_per_token=per_tok * 1e3,
                prompt_tokens=len(out.prompt_token_ids), cached_tokens=out.num_cached_tokens,
                computed_tokens=len(out.prompt_token_ids) - out.num_cached_tokens,
                kv_blocks=usage.used, kv_bytes=usage.used * engine.capacity.block_size * bpt, rss_bytes=_rss()))
        if progress:
            progress(t)
    return records


def _drive(engine, rid: str):
    """Step the engine until ``rid`` finishes; returns (output, ttft seconds, seconds per token)."""
    t0 = time.perf_counter()
    first: float | None = None
    while True:
        for out in engine.step():
            if out.request_id != rid:
                continue
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                end = time.perf_counter()
                n = len(out.outputs[0].token_ids)
                assert first is not None
                return out, first - t0, (end - first) / max(n - 1, 1)


def run(cfg: TurnsConfig, progress: Callable[[str, int], None] | None = None,
        on_mode_done: Callable[[dict], None] | None = None) -> dict:
    """Every requested mode, one after another, in one process. Returns the JSON document;
    ``on_mode_done`` gets the partial document after each mode (so a long run that is stopped
    keeps what it measured)."""
    from kvserve.bench import hf_reference
    from kvserve.bench.machine import cpu_info

    modes: dict[str, dict] = {}
    doc: dict = {"config": asdict(cfg), "cpu": cpu_info(), "threads": torch.get_num_threads(), "modes": modes,
                 "summary": {}}
    for mode in cfg.modes:
        cb = (lambda t, m=mode: progress(m, t)) if progress else None
        if mode in ENGINE_MODES:
            restart: dict = {}
            recs = run_engine_mode(cfg, mode, cb, restart)
            if restart:
                doc["restart"] = restart
        else:
            recs = hf_reference.run_hf_mode(cfg, mode, cb)
        modes[mode] = {"turns": [asdict(r) for r in recs]}
        doc["summary"] = summarize(modes, cfg.turns)
        if on_mode_done:
            on_mode_done(doc)
    return doc


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def per_turn(mode_doc: dict, key: str) -> dict[int, float]:
    """Median of ``key`` over conversations, per turn."""
    by_turn: dict[int, list[float]] = {}
    for r in mode_doc["turns"]:
        by_turn.setdefault(r["turn"], []).append(r[key])
    return {t: _median(v) for t, v in sorted(by_turn.items())}


def summarize(modes: dict[str, dict], turns: int) -> dict[str, dict]:
    """Turn 1 vs turn min(37, T): the articles' incident turn."""
    late = min(37, turns)
    out: dict[str, dict] = {}
    for mode, doc in modes.items():
        ttft = per_turn(doc, "ttft_s")
        mspt = per_turn(doc, "ms_per_token")
        cached = per_turn(doc, "cached_tokens")
        prompt = per_turn(doc, "prompt_tokens")
        # the ideal hit at turn t is the whole previous history: prompt minus this turn's new tokens
        new_tokens = prompt[1]
        ideal = sum(prompt[t] - new_tokens for t in prompt if t > 1)
        out[mode] = {
            "late_turn": late,
            "ttft_turn1_s": ttft[1], "ttft_late_s": ttft[late], "ttft_ratio": ttft[late] / ttft[1],
            "ms_per_token_turn1": mspt[1], "ms_per_token_late": mspt[late],
            "ms_per_token_ratio": mspt[late] / mspt[1],
            "cached_fraction_of_ideal": (sum(cached[t] for t in cached if t > 1) / ideal) if ideal else 0.0,
        }
    if "none" in out:
        base = out["none"]["ttft_late_s"]
        for summary in out.values():
            summary["speedup_vs_none_late"] = base / summary["ttft_late_s"]
    if "session-tiers" in modes:  # the tiers issue's two ratios, per later turn and as medians
        tiers = per_turn(modes["session-tiers"], "ttft_s")
        later = [t for t in tiers if t > 1]
        for other, key in (("session-big", "tiers_over_big"), ("session", "recompute_over_tiers")):
            if other in modes:
                ref = per_turn(modes[other], "ttft_s")
                ratio = {t: (tiers[t] / ref[t] if key == "tiers_over_big" else ref[t] / tiers[t]) for t in later}
                out["session-tiers"][key + "_per_turn"] = ratio
                out["session-tiers"][key + "_median"] = _median(list(ratio.values()))
    return out
