"""The engine: schedule, run the model, update, emit outputs — one step at a time.

``step()`` is the whole loop body::

    plan    = scheduler.schedule()             # SchedulerOutput: plain data (kvserve.contract)
    result  = runner.execute(plan)             # RunnerOutput: tokens per request, failures
    changed = scheduler.update(plan, result)   # advance, append tokens, token-level stops
    return outputs.process(changed, result)    # detokenize, stop strings, group n samples

The runner is inline (this process) or a child process (``runner="process"``); both take and
return the same records.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.config import SESSION_OVERFLOW, EngineConfig, SchedulerConfig, SpeculativeConfig, normalize_dtype
from kvserve.contract import SchedulerOutput
from kvserve.engine.memory import calibration_summary, fit_max_model_len, kv_capacity, pick_device
from kvserve.engine.output_processor import OutputProcessor
from kvserve.kv.codec_names import kv_lossy
from kvserve.kv.codec_pairs import CodecPairs
from kvserve.kv.hashing import model_identity, root_key
from kvserve.kv.layout import KVCapacity, model_kv_bytes_per_token, resolve_kv_dtype
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix_pins import cache_pins
from kvserve.kv.press import PressSpec, parse_press
from kvserve.kv.session_store import attach_session_stores
from kvserve.kv.sessions import Session
from kvserve.model.loader import load_model_config, load_tokenizer
from kvserve.parallel import worker_config
from kvserve.request import Request, RequestOutput, RequestStatus
from kvserve.runner.draft_runner import DraftSpec, check_draft_model
from kvserve.runner.process_runner import RunnerSpec, make_runner
from kvserve.runner.protocol import Runner
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler

log = logging.getLogger("kvserve")

PromptType = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for logs, metrics and tests."""

    num_running: int
    num_waiting: int
    blocks_total: int
    blocks_used: int
    blocks_cached_free: int
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    sessions_active: int = 0
    sessions_expired: int = 0
    sessions_evicted: int = 0
    blocks_pinned: int = 0
    spec_verifies: int = 0          # speculative decoding: verify chunks run,
    spec_draft_tokens: int = 0      # draft tokens proposed,
    spec_accepted_tokens: int = 0   # and of those, accepted


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        dtype = "auto" if config.dtype == "auto" else normalize_dtype(config.dtype)
        self.model_config = load_model_config(config.model, dtype)
        self.tokenizer = load_tokenizer(config.model)
        self.calibration = None  # a per-layer map chosen against kv_quality_budget (docs/kv-quant.md)
        if config.cache.calibrated:
            from kvserve.eval.calibrate import resolve_calibration

            self.calibration = resolve_calibration(config, self.model_config, self.tokenizer)
        self.kv_dtype = (self.calibration.kv_dtype if self.calibration is not None else
                         resolve_kv_dtype(config.cache.kv_cache_dtype, self.model_config.dtype))
        self.max_model_len = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        # one worker's share under tensor parallelism (kvserve.parallel): its heads, its budget
        worker_model, worker_cache = worker_config(self.model_config, config, self.device.type)
        self.capacity: KVCapacity = kv_capacity(worker_model, worker_cache, self.kv_dtype,
                                                self.max_model_len, self.device, config.scheduler.max_num_seqs)
        sched = config.scheduler
        chunk = sched.max_num_batched_tokens if sched.enable_chunked_prefill else self.max_model_len
        self.max_model_len = fit_max_model_len(self.max_model_len, self.capacity, sched.max_model_len,
                                               self.model_config.sliding_window, chunk)
        log.info(self.capacity.summary())
        if self.calibration is not None:
            log.info(calibration_summary(self.calibration, self.capacity, self.model_config, config.cache,
                                         self.max_model_len, self.device, sched.max_num_seqs))
        self.codecs = CodecPairs.for_model(self.model_config, self.kv_dtype, config.cache, self.capacity.block_size)
        root = root_key(model_identity(config.model), self.kv_dtype, self.capacity.block_size)
        self.kv = KVCacheManager(self.capacity.num_blocks, self.capacity.block_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching, root_key=root,
                                 tiers=config.cache.tiers,
                                 session_demote_after_s=config.cache.session_demote_after_s,
                                 tier_write=config.cache.kv_tier_write,
                                 session_idle_timeout_s=config.cache.session_idle_timeout_s,
                                 session_retention_s=config.cache.session_retention_s,
                                 max_sessions_per_tenant=config.cache.max_sessions_per_tenant,
                                 sliding_window=self.model_config.sliding_window)
        self.scheduler = Scheduler(self._scheduler_config(), self.kv, self.max_model_len)
        spec = RunnerSpec(config.model, dtype, str(self.device), self.capacity, self.kv_dtype, config.cache,
                          config.num_threads, config.seed, root, config.attention_backend,
                          config.tensor_parallel_size, draft=self._draft_spec())
        self.runner: Runner = make_runner(spec, config.runner)
        self.kv.tiers.index.load_snapshot(self.runner.tier_snapshot())  # e.g. the disk tier after a restart
        restored = attach_session_stores(self.kv.sessions, config.cache)
        if restored:
            log.info("restored %d session(s) from the KV tiers' session records", restored)
            self.kv.expect_remote_history()
        self._seeds = random.Random(config.seed)  # seeds of requests that give none
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._eos = self._eos_token_ids()

    def _scheduler_config(self) -> SchedulerConfig:
        """The scheduler's settings; drafting is switched off on a lossy KV codec (an int4 key
        group encoded over a rejected draft would keep it: not verified, so not allowed)."""
        sched = self.config.scheduler
        if sched.speculative.enabled and kv_lossy(self.kv_dtype, self.model_config.dtype):
            log.warning("speculative decoding is off: KV codec %s is lossy (drafts need a float KV pool)",
                        self.kv_dtype)
            return dataclasses.replace(sched, speculative=SpeculativeConfig())
        return sched

    def _draft_spec(self) -> DraftSpec | None:
        """The runner's draft model (speculative method ``"draft"``), checked against this model."""
        spec = self.scheduler.config.speculative
        if not spec.by_model or spec.draft_model is None:
            return None
        if self.config.tensor_parallel_size > 1:
            raise ValueError("speculative method 'draft' does not run under tensor parallelism; "
                             "use speculative 'ngram' or tensor_parallel_size 1")
        draft = check_draft_model(self.model_config, self.config.model, spec.draft_model)
        bpt = model_kv_bytes_per_token(draft)
        log.info("draft model %s: %d layers; its own KV is %d rows of %d tokens at %d bytes/token (%.1f MiB, "
                 "outside the KV pool's budget)", spec.draft_model, draft.num_hidden_layers, spec.max_num_seqs,
                 self.max_model_len, bpt, spec.max_num_seqs * self.max_model_len * bpt / 2**20)
        return DraftSpec(spec.draft_model, spec.max_num_seqs, self.max_model_len)

    def shutdown(self) -> None:
        """Stop the runner (a child process for ``runner="process"``)."""
        self.runner.shutdown()

    def _eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from config.json, generation_config.json and the tokenizer, together."""
        ids = set(self.model_config.eos_token_ids)
        gen_file = Path(self.config.model) / "generation_config.json"
        if gen_file.exists():
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
            ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(int(i) for i in ids))

    # -- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt is text, a list of token ids, or ``{"prompt_token_ids": [...]}``/``{"prompt": str}``."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one token")
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        raw: list[object] = list(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in raw if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return None, [int(t) for t in raw]  # type: ignore[call-overload]

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    session_id: str | None = None, kv_cache_dtype: str | None = None,
                    tenant: str | None = None, session_overflow: str | None = None,
                    cache_control: Sequence[tuple[int, float]] = (), prompt_cache_key: str | None = None,
                    kv_press: str | PressSpec | None = None) -> str:
        """Queue a request (``n`` samples become ``n`` sibling sequences). Raises ValueError for
        input that can never run; nothing is queued then. ``kv_cache_dtype`` overrides the engine's
        KV codec for this request (it must fit the pool's blocks: docs/kv-quant.md).

        With ``session_id`` the prompt is the *new* turn's tokens only: they are appended to the
        session's history (previous prompts and replies, never re-tokenized), whose KV is reused.
        ``tenant`` owns a new session (its per-tenant cap applies); ``session_overflow`` overrides
        the engine's ``error`` / ``drop_oldest`` choice for a session outgrowing ``max_session_tokens``.

        Prompt caching (:mod:`kvserve.kv.prefix_pins`): ``cache_control`` lists ``(prompt tokens,
        TTL seconds)`` prefixes to pin when the request finishes; ``prompt_cache_key`` pins the
        whole prompt for 5 minutes under that key (the key's previous prompt is let go). Not for
        session turns: a session keeps its own history's KV.

        ``kv_press`` opts this request into a KV eviction policy (``"sinks:4,1024"``,
        ``"snapkv:0.5"``, ``"h2o:0.5"``: docs/eviction.md); off by default."""
        params = params or SamplingParams()
        press = parse_press(kv_press)
        text, ids = self.tokenize(prompt)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.outputs.groups:
            raise ValueError(f"request id {rid!r} is already in use")
        num_new = len(ids)
        if session_id is not None:
            ids, windowed = self._session_prompt(session_id, ids, params, session_overflow)
            press = press or windowed
        self.scheduler.validate(len(ids), params.max_tokens, press)
        pins = cache_pins(cache_control, prompt_cache_key, len(ids), session_id is not None)
        codec = self._request_codec(kv_cache_dtype)
        if session_id is not None:
            self.kv.begin_turn(session_id, len(ids) - num_new, tenant)
        leader: Request | None = None
        children: list[Request] = []
        base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        for i in range(params.n):
            child = Request(f"{rid}" if params.n == 1 else f"{rid}#{i}", list(ids), params,
                            eos_token_ids=self._eos, group_id=rid, sample_index=i,
                            leader=leader, cache_salt=cache_salt, session_id=session_id,
                            kv_cache_dtype=codec, seed=base_seed + 1_000_003 * i, kv_press=press)
            child.cache_pins = pins
            leader = leader or child
            children.append(child)
        for child in children:
            self.scheduler.add_request(child)
        self.outputs.add_group(rid, text, ids, children)
        return rid

    def _request_codec(self, name: str | None) -> str | None:
        """A per-request KV codec, canonical; None when it is the engine's own. Raises ValueError
        for an unknown codec or one that does not fit the pool."""
        canon = None if name is None else resolve_kv_dtype(name, self.model_config.dtype)
        if canon is None or canon == self.kv_dtype:
            return None
        self.codecs.pair_for(canon)
        return canon

    def _session_prompt(self, session_id: str, new_ids: list[int], params: SamplingParams,
                        overflow: str | None = None) -> tuple[list[int], PressSpec | None]:
        """History + new turn, applying ``max_session_tokens`` (error, drop the oldest turns, or
        ``window``: the turn keeps the first ``session_sink_tokens`` and the last tokens in KV, at
        most ``max_session_tokens`` in all, under a ``sinks`` policy). Returns the tokens and that
        policy (None unless ``window`` applies)."""
        if params.n != 1:
            raise ValueError("n > 1 cannot continue a session; use n=1 with session_id")
        session = self.kv.sessions.get(session_id)
        if session is not None and session.busy:
            raise ValueError(f"session {session_id!r} is already serving a turn; wait for it to finish")
        history = list(session.token_ids) if session else []
        cap = self.config.cache.max_session_tokens
        need = len(history) + len(new_ids) + params.max_tokens
        if cap is not None and need > cap:
            overflow = overflow or self.config.cache.session_overflow
            if overflow not in SESSION_OVERFLOW:
                raise ValueError(f"session_overflow must be one of {', '.join(SESSION_OVERFLOW)}, got {overflow!r}")
            if overflow == "window":
                sinks = min(self.config.cache.session_sink_tokens, cap - 1)
                return history + new_ids, PressSpec("sinks", sink_tokens=sinks, window_tokens=cap - sinks)
            if overflow == "error" or session is None:
                raise ValueError(
                    f"session {session_id!r} would hold {need} tokens (history {len(history)} + new "
                    f"{len(new_ids)} + max_tokens {params.max_tokens}) > max_session_tokens ({cap}); "
                    f"close the session or enable session_overflow='drop_oldest' or 'window'"
                )
            history = self._drop_oldest_turns(session, need - cap)
        return history + new_ids, None

    def _drop_oldest_turns(self, session: Session, excess: int) -> list[int]:
        """Drop whole turns from the front until ``excess`` tokens are gone; the KV is released
        (positions shift, so it must be recomputed)."""
        boundaries = [t for t in session.turn_starts if t > 0] + [len(session.token_ids)]
        cut = next((t for t in boundaries if t >= excess), None)
        if cut is None:
            raise ValueError(f"session {session.session_id!r}: the new turn alone exceeds max_session_tokens "
                             f"({self.config.cache.max_session_tokens}); send a shorter turn or lower max_tokens")
        self.kv.drop_oldest_turns(session, cut)
        return list(session.token_ids)

    def set_session_meta(self, session_id: str, meta: dict[str, Any]) -> bool:
        """Attach the front end's record to a session (persisted with it). False if it is gone."""
        session = self.kv.sessions.get(session_id)
        if session is None:
            return False
        self.kv.sessions.set_meta(session, meta)
        return True

    def list_sessions(self) -> list[Session]:
        return self.kv.sessions.all()

    def close_session(self, session_id: str) -> bool:
        """Forget a session and free its KV. Returns False if it did not exist."""
        session = self.kv.sessions.get(session_id)
        if session is not None and session.busy:
            for group_id, group in list(self.outputs.groups.items()):
                if any(c.session_id == session_id for c in group.children):
                    self.abort_request(group_id)
        return self.kv.close_session(session_id)

    def abort_request(self, request_id: str) -> None:
        """Stop a request (or every sample of it) now; its blocks come back at once."""
        for child in self.outputs.children(request_id):
            self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.empty and not plan.block_ops and not self.kv.tiers.loads_in_flight:
            return self.outputs.flush()  # aborts still need their final output
        result = self.runner.execute(plan)
        changed = self.scheduler.update(plan, result)
        outputs = self.outputs.process(changed, result, self._stop_by_string)
        if not self.scheduler.has_unfinished and self.kv.has_pending_ops:
            self._flush_block_ops()  # idle: the last blocks' saves run now, before the outputs leave
        return outputs

    def _flush_block_ops(self) -> None:
        ops = SchedulerOutput(block_ops=self.kv.take_block_ops())
        self.scheduler.update(ops, self.runner.execute(ops))

    def _stop_by_string(self, req: Request, stop: str) -> None:
        self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop)

    def stats(self) -> EngineStats:
        usage = self.kv.usage()
        ss = self.kv.sessions.stats
        spec = self.scheduler.drafter.stats if self.scheduler.drafter else None
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, usage.total,
                           usage.used, usage.cached_free, self.scheduler.num_preemptions,
                           self.kv.stats.queries, self.kv.stats.hits, len(self.kv.sessions),
                           ss.expired, ss.evicted, self.kv.num_pinned_blocks(),
                           *((spec.verifies, spec.proposed, spec.accepted) if spec else ()))

    def run_until_done(self, timeout_s: float | None = None, max_idle_steps: int = 10_000) -> list[RequestOutput]:
        """Step until every request finishes; returns the final output of each. Raises RuntimeError
        if ``max_idle_steps`` steps in a row schedule nothing (a request that can never be admitted:
        admission rules should make this impossible, this makes it loud instead of a spin)."""
        done: dict[str, RequestOutput] = {}
        start = time.monotonic()
        idle = 0
        while self.has_unfinished_requests():
            outs = self.step()
            for out in outs:
                if out.finished:
                    done[out.request_id] = out
            idle = 0 if outs or self.scheduler.num_running or self.kv.tiers.loads_in_flight else idle + 1
            if idle > max_idle_steps:
                raise RuntimeError(f"{self.scheduler.num_waiting} request(s) waiting but none admitted in "
                                   f"{max_idle_steps} steps")
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise TimeoutError(f"requests still unfinished after {timeout_s} s")
        return list(done.values())
