"""The offline Python API, mirroring vLLM's ``LLM``::

    llm = LLM(model="path/to/checkpoint", dtype="bfloat16", kv_cache_memory="1GiB")
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids
    llm.chat([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Self, cast

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig, parse_size
from kvserve.engine.chat_session import ChatTranscript
from kvserve.engine.engine import LLMEngine, PromptType
from kvserve.kv.press import PressSpec, parse_press
from kvserve.request import RequestOutput
from kvserve.sampling_params import SamplingParams

Message = dict[str, str]


def resolve_model_path(model: str | Path | None) -> str:
    """``None`` means the embedded default model shipped with the package."""
    if model is None:
        from kvserve.assets import default_model_path

        return str(default_model_path())
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(model)!r} does not exist; pass a local Hugging Face checkpoint folder")
    return str(path)


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        kv_cache_memory: str | int | None = None,
        kv_cache_fraction: float = 0.3,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_chunked_prefill: bool = True,
        seed: int = 0,
        num_threads: int | None = None,
        session_idle_timeout_s: float = 600.0,
        max_session_tokens: int | None = None,
        session_overflow: str = "error",
        session_sink_tokens: int = CacheConfig.session_sink_tokens,
        kv_quant_min_tokens: int = CacheConfig.kv_quant_min_tokens,
        kv_quant_group_size: int | None = None,
        kv_quant_sink_tokens: int = CacheConfig.kv_quant_sink_tokens,
        kv_quality_budget: str | None = None,
        kv_calibration: str | Path | None = None,
        runner: str = "inline",
        kv_host_memory: str | int | None = None,
        kv_disk_dir: str | Path | None = None,
        kv_disk_size: str | int = "50GiB",
        kv_remote: str | None = None,
        session_demote_after_s: float = CacheConfig.session_demote_after_s,
        kv_tier_eviction: str = "lru",
        kv_tier_write: str = "through",
        session_retention_s: float | None = None,
        max_sessions_per_tenant: int | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int = SpeculativeConfig.num_speculative_tokens,
        speculative_max_num_seqs: int = SpeculativeConfig.max_num_seqs,
        draft_model: str | Path | None = None,
        attention_backend: str = "auto",
        tensor_parallel_size: int = 1,
    ) -> None:
        cache = CacheConfig(
            block_size=block_size,
            kv_cache_memory=None if kv_cache_memory is None else parse_size(kv_cache_memory),
            kv_cache_fraction=kv_cache_fraction,
            kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
            num_blocks_override=num_blocks,
            session_idle_timeout_s=session_idle_timeout_s,
            max_session_tokens=max_session_tokens,
            session_overflow=session_overflow,
            session_sink_tokens=session_sink_tokens,
            kv_quant_min_tokens=kv_quant_min_tokens,
            kv_quant_group_size=kv_quant_group_size,
            kv_quant_sink_tokens=kv_quant_sink_tokens,
            kv_quality_budget=kv_quality_budget,
            kv_calibration=None if kv_calibration is None else str(kv_calibration),
            kv_host_memory=None if kv_host_memory is None else parse_size(kv_host_memory),
            kv_disk_dir=None if kv_disk_dir is None else str(kv_disk_dir),
            kv_disk_size=parse_size(kv_disk_size),
            kv_remote=kv_remote,
            session_demote_after_s=session_demote_after_s,
            kv_tier_eviction=kv_tier_eviction,
            kv_tier_write=kv_tier_write,
            session_retention_s=session_retention_s,
            max_sessions_per_tenant=max_sessions_per_tenant,
        )
        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                                speculative=SpeculativeConfig(
                                    speculative, num_speculative_tokens, max_num_seqs=speculative_max_num_seqs,
                                    draft_model=None if draft_model is None else str(draft_model)))
        config = EngineConfig(model=resolve_model_path(model), dtype=dtype, device=device, seed=seed,
                              num_threads=num_threads, cache=cache, scheduler=sched, runner=runner,
                              attention_backend=attention_backend,
                              tensor_parallel_size=tensor_parallel_size)
        self.engine = LLMEngine(config)
        self._transcripts: dict[str, ChatTranscript] = {}
        self.last_output: RequestOutput | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        obj = cls.__new__(cls)
        obj.engine = LLMEngine(config)
        obj._transcripts = {}
        obj.last_output = None
        return obj

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, session_id: str | None = None, cache_salt: str | None = None,
                 kv_cache_dtype: str | None = None, kv_press: str | PressSpec | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. All prompts are
        checked before any is queued, so one bad prompt loses nothing.

        ``session_id`` (one prompt only) appends the prompt to that session's history and reuses
        its KV; ``cache_salt`` keeps prefix-cache hits within one tenant; ``kv_cache_dtype``
        overrides the engine's KV codec for these prompts (docs/kv-quant.md); ``kv_press`` runs them
        under a KV eviction policy (``"sinks:4,1024"``, ``"snapkv:0.5"``, ``"h2o:0.5"``;
        docs/eviction.md)."""
        press = parse_press(kv_press)
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        prompts = cast(list[PromptType], prompts)
        params = self._params_list(sampling_params, len(prompts))
        if session_id is not None:
            if len(prompts) != 1:
                raise ValueError("session_id continues one conversation: pass exactly one prompt")
            rid = self.engine.add_request(prompts[0], params[0], session_id=session_id, cache_salt=cache_salt,
                                          kv_cache_dtype=kv_cache_dtype, kv_press=press)
            return [self._run([rid])[0]]
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                _, ids = self.engine.tokenize(p)
                self.engine.scheduler.validate(len(ids), sp.max_tokens, press)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        if kv_cache_dtype is not None:
            self.engine._request_codec(kv_cache_dtype)  # refuse a bad codec before queuing anything
        return self._run([self.engine.add_request(p, sp, cache_salt=cache_salt, kv_cache_dtype=kv_cache_dtype,
                                                  kv_press=press)
                          for p, sp in zip(prompts, params)])

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done = {o.request_id: o for o in self.engine.run_until_done()}
        return [done[i] for i in ids]

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | None = None, *, session_id: str | None = None) -> list[RequestOutput]:
        """Chat completion. With ``session_id``, ``messages`` are only the *new* messages of this
        turn: the session keeps the history (as tokens, and its KV) between calls."""
        if session_id is not None:
            transcript = self._transcripts.setdefault(session_id, ChatTranscript(self.tokenizer))
            try:
                out = self.generate({"prompt_token_ids": transcript.next_turn_ids(messages)},  # type: ignore[arg-type]
                                    sampling_params, session_id=session_id)[0]
            except ValueError:
                transcript.abandon_turn()
                raise
            transcript.record_reply(out.outputs[0].token_ids)
            return [out]
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.chat_token_ids(conv)} for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)

    def shutdown(self) -> None:
        """Stop the engine's runner (the child process of ``runner="process"``)."""
        self.engine.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def close_session(self, session_id: str) -> bool:
        """Forget a chat session and free its KV."""
        self._transcripts.pop(session_id, None)
        return self.engine.close_session(session_id)

    def chat_token_ids(self, messages: list[Message]) -> list[int]:
        """Apply the model's chat template (with the generation prompt) and tokenize."""
        if not messages:
            raise ValueError("messages is empty; give at least one message")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
               *, session_id: str | None = None) -> Iterator[str]:
        """Yield text pieces of one request as they are generated."""
        rid = self.engine.add_request(prompt, sampling_params, session_id=session_id)
        sent = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id != rid:
                    continue
                text = out.outputs[0].text
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)
                if out.finished:
                    self.last_output = out
                    return

    def stream_chat(self, new_messages: list[Message], sampling_params: SamplingParams | None = None,
                    *, session_id: str) -> Iterator[str]:
        """Stream one chat turn of a session (``new_messages`` only; the session keeps the rest)."""
        transcript = self._transcripts.setdefault(session_id, ChatTranscript(self.tokenizer))
        try:
            ids = transcript.next_turn_ids(new_messages)
            yield from self.stream({"prompt_token_ids": ids}, sampling_params, session_id=session_id)
        except ValueError:
            transcript.abandon_turn()
            raise
        assert self.last_output is not None
        transcript.record_reply(self.last_output.outputs[0].token_ids)

    @staticmethod
    def _params_list(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        return list(sp)
