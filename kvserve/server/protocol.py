"""OpenAI API schemas (the subset kvserve serves), as pydantic models.

Requests are validated strictly: a field of the wrong type (``"n": "2"``, ``"temperature":
"hot"``) is a 400, never coerced, and so is a field kvserve does not know (OpenAI ignores them;
kvserve refuses them so that a client never gets a quietly different answer, e.g. vLLM's
``min_tokens`` used to be dropped). Accepted and ignored, documented as harmless: ``user``,
``metadata``, ``store`` (and ``tool_call_id`` on a message). Refused with a 400 naming the field,
though declared so the message can say why: ``functions``, ``function_call``,
``parallel_tool_calls``, ``modalities``, ``audio``, ``prediction``, ``reasoning_effort``,
``service_tier``, assistant ``tool_calls`` in the history.

kvserve extensions (vLLM's names where vLLM has one): ``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``allowed_token_ids``, ``bad_words``, ``stop_token_ids``,
``ignore_eos``, ``include_stop_str_in_output``, ``skip_special_tokens``, ``session_id``,
``session_overflow``, ``cache_salt``, ``kv_cache_dtype``, ``kv_press``, ``return_token_ids``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

HARMLESS_FIELDS = ("user", "metadata", "store")
REFUSED_CHAT_FIELDS = ("functions", "function_call", "parallel_tool_calls", "modalities", "audio",
                       "prediction", "reasoning_effort", "service_tier")


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CacheControl(_Request):
    """A prompt-caching breakpoint: the prompt up to the end of this message (or content part)
    stays cached for ``ttl``, refreshed by every hit (docs/tiers.md)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class _SamplingRequest(_Request):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # accepted and ignored (harmless)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    session_id: str | None = None
    session_overflow: Literal["error", "drop_oldest", "window"] | None = None
    cache_salt: str | None = None
    kv_cache_dtype: str | None = None
    kv_press: str | None = None  # a KV eviction policy: "sinks:S,W", "snapkv:RATIO", "h2o:RATIO" (docs/eviction.md)
    return_token_ids: bool = False
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=256)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Request):
    model_config = ConfigDict(strict=True, extra="ignore")  # non-text parts are refused by type
    type: str
    text: str | None = None
    cache_control: CacheControl | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # accepted, ignored (the template sees the content)
    tool_calls: SkipJsonSchema[list[Any] | None] = None  # refused when non-empty
    cache_control: CacheControl | None = None

    def cache_marker(self) -> CacheControl | None:
        """This message's breakpoint: its own, or its last content part's that has one."""
        if self.cache_control is not None:
            return self.cache_control
        if isinstance(self.content, list):
            return next((p.cache_control for p in reversed(self.content) if p.cache_control is not None), None)
        return None

    def text(self) -> str:
        """The message's text; content parts other than text are refused by the caller."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    # refused with a 400 that names them (declared so the message can say why)
    functions: SkipJsonSchema[Any] = None
    function_call: SkipJsonSchema[Any] = None
    parallel_tool_calls: SkipJsonSchema[Any] = None
    modalities: SkipJsonSchema[Any] = None
    audio: SkipJsonSchema[Any] = None
    prediction: SkipJsonSchema[Any] = None
    reasoning_effort: SkipJsonSchema[Any] = None
    service_tier: SkipJsonSchema[Any] = None


# -- responses -------------------------------------------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int
    cache_write_tokens: int | None = None  # prompt caching: tokens written to a pinned prefix


class KVUsage(_Response):
    """Where the prompt's KV came from: tokens found per place, tokens recomputed, time loading
    from the tiers (docs/tiers.md), and why the recomputed tokens were not found
    (``miss_tokens``: reason -> tokens; docs/eviction.md)."""

    hit_tokens: dict[str, int]
    recomputed_tokens: int
    load_ms: float
    miss_tokens: dict[str, int] = {}


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    kv: KVUsage | None = None
    cost: dict[str, float] | None = None  # with prices configured: input, cached_input, output, total, saved_by_cache
    # the prompt-caching API's split, in the names hosted APIs use (set when the request used it)
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob]


class ChatMessageOut(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    session_id: str | None = None
    session_restarted: bool | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    root: str
    max_model_len: int
    kv_cache_dtype: str | None = None  # the engine's KV codec: one pair, or a per-layer map ("layers:…")


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class SessionCard(_Response):
    id: str
    object: Literal["session"] = "session"
    num_tokens: int
    resident: bool
    pinned_blocks: int
    busy: bool
    idle_s: float


class SessionList(_Response):
    object: Literal["list"] = "list"
    data: list[SessionCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# -- /tokenize, /detokenize, /version (vLLM's shapes) -----------------------------------------
class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


class SessionDeleted(_Response):
    id: str
    object: Literal["session.deleted"] = "session.deleted"
    deleted: bool
