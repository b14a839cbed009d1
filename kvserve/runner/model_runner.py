"""Owns the model and the KV storage; runs one step record.

KV storage (:class:`kvserve.kv.storage.KVStorage`): for a float KV dtype, one tensor per layer
``[2, num_blocks, block_size, kv_heads, head_dim]``; for a lossy codec (fp8, int8, int4) one byte
tensor per layer holding each block's codec fields, plus the full-precision window. Its byte size
equals ``KVCapacity.allocated_bytes`` (checked at start-up), so what the engine reports is what it
holds.

A step (:meth:`ModelRunner.execute`): read the record into the runner's per-request state, run
the block operations, the draft model's proposals where a chunk has placeholders
(``model_drafts``: :mod:`kvserve.runner.draft_runner`), one forward over every chunk, sample. A
verify chunk (``num_sample = k + 1``)
keeps the drafts up to the first one the sampled tokens disagree with; the runner's copy of the
request's tokens is cut there (the scheduler counts the same: ``Scheduler.update``). If the forward or a sample raises,
the fault is attributed: each chunk is rerun alone and the ones that still raise are reported in
``RunnerOutput.failed``; the rest are served. Only a fault no request explains (every chunk fails
alone, in a batch of several) propagates and stops the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvserve.config import CacheConfig, ModelConfig
from kvserve.contract import RunnerOutput, SampledTokens, ScheduledChunk, SchedulerOutput, TokenLogprobs
from kvserve.kv.codec_names import parse_layer_codecs
from kvserve.kv.layout import KVCapacity, int4_group_size
from kvserve.kv.storage import KVStorage
from kvserve.kv.tiers.stack import TierStack
from kvserve.model.attention_backends import DEFAULT_BACKEND
from kvserve.model.attention_choice import backend_for
from kvserve.model.llama import LlamaForCausalLM
from kvserve.native.fused import _ext as fused_ops_module
from kvserve.runner import decode_graphs
from kvserve.runner.block_ops import run_block_ops
from kvserve.runner.draft_runner import DraftRunner
from kvserve.runner.inputs import ModelInputs, build_inputs
from kvserve.runner.peers import PeerHub
from kvserve.runner.sampler import Sampler
from kvserve.runner.state import RequestState, RunnerState
from kvserve.runner.tier_loader import TierLoader

log = logging.getLogger("kvserve")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, capacity: KVCapacity,
                 kv_dtype: str, device: torch.device, seed: int = 0, cache: CacheConfig | None = None,
                 attention_backend: str = DEFAULT_BACKEND, tokenizer_path: str | None = None,
                 tiers: TierStack | None = None, root_key: bytes = b"", draft: DraftRunner | None = None) -> None:
        self.model = model
        self.config = model_config
        self.capacity = capacity
        self.device = device
        self.sampler = Sampler()
        self.state = RunnerState()
        # auto (measured on this machine), forced, or a registered backend
        self.attention = backend_for(attention_backend, model_config, capacity.block_size,
                                     torch_dtype(model_config.dtype), device)
        if device.type == "cpu":
            fused_ops_module()  # built (or loaded) now, at start-up, not on the first request
        self._tokenizer_path = tokenizer_path  # loaded on the first response_format request
        self._tokenizer: Any = None
        self.tiers = tiers
        self.loader = TierLoader(tiers) if tiers else None
        self.root_key = root_key  # what block objects sent to and received from peers carry
        self.peers = PeerHub()  # SendBlocks / ReceiveBlocks (its listener starts when asked)
        self.draft = draft  # speculative method "draft": fills chunks' model_drafts placeholders
        cache = cache or CacheConfig(block_size=capacity.block_size)
        # torch.empty inside: pages are only touched when written, and reads see written slots only.
        self.storage = KVStorage(
            num_layers=model_config.num_hidden_layers, num_blocks=capacity.num_blocks,
            block_size=capacity.block_size, kv_heads=model_config.num_key_value_heads,
            head_dim=model_config.head_dim, dtype=torch_dtype(model_config.dtype),
            pool=parse_layer_codecs(kv_dtype, model_config.dtype, model_config.num_hidden_layers),
            group_size=int4_group_size(capacity.block_size, cache.kv_quant_group_size),
            window_blocks=capacity.window_blocks, min_tokens=cache.kv_quant_min_tokens,
            sink_tokens=cache.kv_quant_sink_tokens, device=device,
        )
        if self.storage.nbytes != capacity.allocated_bytes:
            raise RuntimeError(f"KV storage holds {self.storage.nbytes} bytes but capacity says "
                               f"{capacity.allocated_bytes}")
        # Decode steps replayed as CUDA graphs (kvserve.runner.decode_graphs); None: every step eager.
        self.graphs: decode_graphs.DecodeGraphs | None = None
        if device.type == "cuda" and decode_graphs.enabled():
            self.graphs = decode_graphs.DecodeGraphs(
                model, capacity.block_size, model_config.sliding_window, device,
                decode_graphs.bucket(capacity.num_blocks, decode_graphs.MIN_BLOCKS))
        self._rows = torch.arange(decode_graphs.MAX_SEQS, device=device)  # a graph step's logits rows

    @property
    def kv_bytes(self) -> int:
        return self.storage.nbytes

    def _forward(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, ModelInputs]:
        """One forward over ``chunks``: final hidden states ``[T, hidden]`` and the inputs."""
        states = self.state.requests
        self.storage.begin_step(chunks, [states[c.request_id].kv_codec for c in chunks])
        try:
            layers = self.storage.layers()
            if self.graphs is not None and self.graphs.eligible(chunks, layers):  # type: ignore[arg-type]
                inputs = build_inputs(chunks, states, self.capacity.block_size, self.config.sliding_window,
                                      torch.device("cpu"))
                hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta, layers)  # type: ignore[arg-type]
                inputs.logits_indices = self._rows[:len(chunks)]
                return hidden, inputs
            inputs = build_inputs(chunks, states, self.capacity.block_size, self.config.sliding_window,
                                  self.device, self.attention, layers[0].shape)
            hidden = self.model(inputs.input_ids, inputs.positions, layers, inputs.meta)
        finally:
            self.storage.end_step()
        return hidden, inputs

    def _prepare(self, out: SchedulerOutput) -> RunnerOutput:
        """Read the record into the runner's state and run its block operations; returns what
        the operations did in the tiers (the result the step's other fields are added to)."""
        self.state.apply(out)
        for new in out.new_requests:
            if new.sampling.response_format is not None:
                self._attach_matcher(self.state.requests[new.request_id])
        result = RunnerOutput(out.step_id)
        run_block_ops(self.storage, self.tiers, out.block_ops, result, self.loader, self.peers, self.root_key)
        return result

    def _collect_loads(self, result: RunnerOutput, idle: bool) -> None:
        """Report the tier loads that finished while the forward ran; a step with no forward
        waits a little for them instead of returning at once (no spin while only loads run)."""
        if self.loader is not None:
            self.loader.collect(self.storage, result, wait_s=0.2 if idle else 0.0)

    def _attach_matcher(self, state: RequestState) -> None:
        """A grammar matcher for the request's ``response_format``, advanced over the tokens it
        already generated (a request readmitted after preemption)."""
        from kvserve.runner.structured import from_tokenizer

        if self._tokenizer is None:
            from kvserve.model.loader import load_tokenizer

            if self._tokenizer_path is None:
                raise ValueError("response_format needs the runner to know the tokenizer")
            self._tokenizer = load_tokenizer(self._tokenizer_path)
        matcher = from_tokenizer(self._tokenizer, state.sampling.response_format, vocab_size=self.config.vocab_size,
                                 stop_token_ids=state.eos_token_ids)
        if matcher is not None:
            for token in state.token_ids[state.num_prompt_tokens:]:
                matcher.accept(token)
            state.extra["matcher"] = matcher

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the model over every scheduled chunk; sample where a chunk asks for it."""
        ops = self._prepare(out)
        if not out.chunks:
            self._collect_loads(ops, idle=True)
            return ops
        try:
            result = self._run(out.chunks)
        except Exception as batch_error:  # noqa: BLE001 - attribute it to requests, or re-raise
            result = self._isolate(out.chunks, batch_error)
        self._collect_loads(ops, idle=False)
        result.step_id, result.tier_events, result.loaded = out.step_id, ops.tier_events, ops.loaded
        return result

    def _run(self, chunks: Sequence[ScheduledChunk]) -> RunnerOutput:
        if any(c.model_drafts for c in chunks):
            if self.draft is None:
                raise ValueError("a chunk asks for model drafts but this runner has no draft model")
            self.draft.fill(chunks, self.state.requests)
        hidden, inputs = self._forward(chunks)
        result = RunnerOutput()
        if inputs.meta.block_scores:  # only chunks whose policy asked (ScheduledChunk.score_queries)
            result.block_scores = {chunks[i].request_id: s.tolist() for i, s in inputs.meta.block_scores.items()}
        if not inputs.sample_rows:
            return result
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        drawn = self.sampler.sample(logits, inputs.sample_rows)
        i = 0
        for c, count in zip(chunks, inputs.sample_counts):
            mine, i = drawn[i:i + count], i + count
            if not count:
                continue
            error = next((d for d in mine if isinstance(d, Exception)), None)
            if error is not None:
                result.failed[c.request_id] = f"sampling failed: {error!r}"
                continue
            known = self.state.requests[c.request_id].token_ids
            result.sampled[c.request_id] = accepted = _accepted(c, mine, known)  # type: ignore[arg-type]
            if c.num_sample > 1:  # the rejected drafts leave the runner's copy
                del known[c.end - c.num_sample + len(accepted.token_ids):]
        return result

    def _isolate(self, chunks: Sequence[ScheduledChunk], batch_error: Exception) -> RunnerOutput:
        """Rerun each chunk alone; those that still raise fail, the others are served."""
        if len(chunks) == 1:
            log.warning("request %s failed: %r", chunks[0].request_id, batch_error)
            return RunnerOutput(failed={chunks[0].request_id: f"{batch_error!r}"})
        merged = RunnerOutput()
        errors: list[Exception] = []
        for c in chunks:
            try:
                one = self._run([c])
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                merged.failed[c.request_id] = f"{e!r}"
                log.warning("request %s failed: %r", c.request_id, e)
                continue
            merged.sampled.update(one.sampled)
            if one.block_scores:
                merged.block_scores = {**(merged.block_scores or {}), **one.block_scores}
            merged.failed.update(one.failed)
        if len(errors) == len(chunks):
            raise batch_error
        return merged

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of every scheduled token, no logits (benchmarks)."""
        self._prepare(out)
        return self._forward(out.chunks)[0]

    @torch.inference_mode()
    def score(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits ``[T, vocab]`` (float32) of every scheduled token: teacher-forced evaluation."""
        self._prepare(out)
        hidden, _ = self._forward(out.chunks)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def score_blocks(self, out: SchedulerOutput) -> tuple[torch.Tensor, dict[str, list[float]]]:
        """As :meth:`score`, with the block scores the chunks asked for (``score_queries``)."""
        self._prepare(out)
        hidden, inputs = self._forward(out.chunks)
        scores = {out.chunks[i].request_id: s.tolist() for i, s in inputs.meta.block_scores.items()}
        return self.model.compute_logits(hidden), scores

    def tier_snapshot(self) -> dict[str, list[tuple[bytes, int]]]:
        """What each local KV tier holds (the disk tier's index rebuilt at start-up)."""
        return self.tiers.snapshot() if self.tiers else {}

    def shutdown(self) -> None:
        """Stop the tier loader's thread (the process runner stops its child here)."""
        if self.loader is not None:
            self.loader.close()


def _accepted(chunk: ScheduledChunk, drawn: list[tuple[int, TokenLogprobs | None]],
              known: list[int]) -> SampledTokens:
    """Tokens sampled at a chunk's last ``num_sample`` positions, cut after the first one that
    disagrees with the token already at the next position (greedy verification of drafts)."""
    tokens: list[int] = []
    logprobs: list[TokenLogprobs] = []
    first = chunk.end - chunk.num_sample
    for j, (token, lp) in enumerate(drawn):
        tokens.append(token)
        if lp is not None:
            logprobs.append(lp)
        nxt = first + j + 1
        if nxt < chunk.end and (nxt >= len(known) or known[nxt] != token):
            break
    return SampledTokens(tokens, logprobs if logprobs else None)
