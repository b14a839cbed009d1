"""From an OpenAI request body to :class:`SamplingParams`, and the checks that come first.

Nothing here is silently dropped: a feature kvserve does not have (tools, ``suffix``, ``echo``,
the fields in ``REFUSED_CHAT_FIELDS``) is a 400 naming the field, and every list a client sends
is bounded (``ServerConfig.max_*``) with a 400 that names the limit.
"""

from __future__ import annotations

import re
from typing import Any

from kvserve.kv.prefix_pins import MAX_BREAKPOINTS, TTLS
from kvserve.pricing import Prices
from kvserve.request import RequestOutput
from kvserve.runner.logits_processors import bad_words_token_ids
from kvserve.sampling_params import SamplingParams
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError
from kvserve.server.protocol import (
    REFUSED_CHAT_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    KVUsage,
    PromptTokensDetails,
    Usage,
)

_SESSION_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
_PARAM_OF_MESSAGE = ("n", "max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                     "logprobs", "stop_token_ids", "stop", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "response_format")
Req = CompletionRequest | ChatCompletionRequest


def refuse_unsupported(req: Req) -> None:
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise APIError(400, "suffix is not supported by kvserve", param="suffix")
        if req.echo:
            raise APIError(400, "echo is not supported by kvserve", param="echo")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, f"best_of ({req.best_of}) must equal n ({req.n}) in kvserve", param="best_of")
        return
    if req.tools or req.tool_choice not in (None, "none"):
        raise APIError(400, "tools and tool_choice are not supported by kvserve", param="tools")
    for name in REFUSED_CHAT_FIELDS:
        if getattr(req, name) is not None:
            raise APIError(400, f"{name} is not supported by kvserve; remove it from the request", param=name)
    for i, m in enumerate(req.messages):
        if m.tool_calls:
            raise APIError(400, f"messages[{i}].tool_calls: tool calls are not supported by kvserve "
                                "(they would be dropped from the history)", param=f"messages.{i}.tool_calls")
        if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
            raise APIError(400, f"messages[{i}]: only text content parts are supported",
                           param=f"messages.{i}.content")


def cache_breakpoints(req: Req) -> list[tuple[int, float]]:
    """(message index, TTL seconds) of each ``cache_control`` marker of a chat request, checked:
    at most four, and none on a session turn (the session keeps its history's KV itself)."""
    if isinstance(req, CompletionRequest):
        return []
    marks = [(i, TTLS[m.ttl]) for i, msg in enumerate(req.messages) if (m := msg.cache_marker()) is not None]
    if len(marks) > MAX_BREAKPOINTS:
        raise APIError(400, f"at most {MAX_BREAKPOINTS} cache_control breakpoints per request, got {len(marks)}",
                       param="messages")
    return marks


def uses_prompt_caching(req: Req) -> bool:
    return req.prompt_cache_key is not None or bool(cache_breakpoints(req))


def refuse_caching_in_session(req: Req, sid: str | None) -> None:
    if sid is not None and uses_prompt_caching(req):
        raise APIError(400, "cache_control and prompt_cache_key do not apply to session turns: the session "
                            "already keeps its history's KV; drop them or drop session_id",
                       param="prompt_cache_key" if req.prompt_cache_key is not None else "messages")


def _limit(count: int, limit: int, what: str, param: str) -> None:
    if count > limit:
        raise APIError(400, f"{what}: {count} given, the limit is {limit}", param=param)


def _in_vocab(ids: list[int], vocab: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"{param} must be token ids in [0, {vocab}); got {bad[:5]}", param=param)


def check_limits(req: Req, cfg: ServerConfig, vocab_size: int) -> None:
    """400 naming the limit for every list or count a request could make unbounded."""
    if req.n > cfg.max_n:
        raise APIError(400, f"n ({req.n}) is over this server's limit max_n={cfg.max_n}", param="n")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    _limit(len(stops), cfg.max_stop, "stop: too many stop strings", "stop")
    longest = max((len(s) for s in stops), default=0)
    _limit(longest, cfg.max_stop_chars, "stop: a stop string is too long (characters)", "stop")
    _limit(len(req.stop_token_ids or []), cfg.max_stop_token_ids, "stop_token_ids: too many",
           "stop_token_ids")
    _in_vocab(list(req.stop_token_ids or []), vocab_size, "stop_token_ids")
    _limit(len(req.logit_bias or {}), cfg.max_logit_bias, "logit_bias: too many entries", "logit_bias")
    _limit(len(req.bad_words or []), cfg.max_bad_words, "bad_words: too many words", "bad_words")
    _limit(max((len(w) for w in req.bad_words or []), default=0), cfg.max_stop_chars,
           "bad_words: a word is too long (characters)", "bad_words")
    if req.allowed_token_ids is not None:
        _limit(len(req.allowed_token_ids), vocab_size, "allowed_token_ids: more ids than the vocabulary",
               "allowed_token_ids")
        _in_vocab(req.allowed_token_ids, vocab_size, "allowed_token_ids")


def _logit_bias(raw: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
    if not raw:
        return None
    out: dict[int, float] = {}
    for key, bias in raw.items():
        try:
            tid = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key[:40]!r}",
                           param="logit_bias") from None
        if not 0 <= tid < vocab:
            raise APIError(400, f"logit_bias: token id {tid} is not in [0, {vocab})", param="logit_bias")
        out[tid] = bias
    return out


def session_id_of(body_value: str | None, header_value: str | None) -> str | None:
    """``session_id`` from the body, else the ``X-Session-Id`` header; checked for shape."""
    sid = body_value if body_value is not None else header_value
    if sid is not None and not _SESSION_ID.match(sid):
        raise APIError(400, "session_id must be 1-128 characters of letters, digits and ._:@-",
                       param="session_id")
    return sid


def sampling_params(req: Req, max_tokens: int, logprobs: int | None, tokenizer: Any = None,
                    vocab_size: int | None = None) -> SamplingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    vocab = vocab_size if vocab_size is not None else 2**31
    bias = _logit_bias(req.logit_bias, vocab)
    words = tuple(req.bad_words or ())
    word_ids = bad_words_token_ids(tokenizer, words) if words and tokenizer is not None else ()
    rf = req.response_format
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias,
            allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
            bad_words=words, bad_words_token_ids=word_ids,
            response_format=None if rf is None or rf.get("type") == "text" else rf,
        )
    except ValueError as exc:
        msg = str(exc)
        param = next((p for p in _PARAM_OF_MESSAGE if msg.startswith(p)), None)
        raise APIError(400, msg, param=param) from None


def check_response_format(state_tokenizer: Any, params: SamplingParams, vocab_size: int) -> None:
    """A schema that cannot be compiled is the client's error (400), found before queueing."""
    if not params.structured:
        return
    from kvserve.runner.structured import validate_response_format

    try:
        validate_response_format(state_tokenizer, params.response_format, vocab_size=vocab_size)
    except ValueError as exc:
        raise APIError(400, str(exc), param="response_format") from None
    except ImportError:  # pragma: no cover - xgrammar is a dependency
        raise APIError(400, "response_format needs the xgrammar package", param="response_format") from None


def default_chat_max_tokens(prompt_tokens: int, max_model_len: int) -> int:
    """OpenAI's chat default: whatever room the context leaves."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise APIError(400, f"prompt ({prompt_tokens} tokens) leaves no room to generate within "
                            f"max_model_len ({max_model_len}); shorten the messages", param="messages")
    return room


def usage_of(outputs: list[RequestOutput], prices: Prices | None = None, prompt_caching: bool = False) -> Usage:
    """Prompt tokens count once per prompt (not per sample); cached tokens are prefix/session hits.
    ``prompt_caching`` (the request used ``cache_control`` or ``prompt_cache_key``): the usage
    also splits cache writes from cache reads."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    hits = {place: 0 for place in ("pool", "host", "disk", "remote")}
    for o in outputs:
        for place, n in o.kv_hit_tokens.items():
            hits[place] = hits.get(place, 0) + n
    misses: dict[str, int] = {}
    for o in outputs:
        for reason, n in o.kv_miss_tokens.items():
            misses[reason] = misses.get(reason, 0) + n
    kv = KVUsage(hit_tokens=hits, recomputed_tokens=prompt - cached,
                 load_ms=round(sum(o.kv_load_seconds for o in outputs) * 1e3, 3), miss_tokens=misses)
    written = sum(o.cache_write_tokens for o in outputs)
    cost = prices.cost(prompt, cached, completion, written) if prices is not None and prices.enabled else None
    split = {"cache_creation_input_tokens": written, "cache_read_input_tokens": cached} if prompt_caching else {}
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached,
                                                           cache_write_tokens=written if prompt_caching else None),
                 kv=kv, cost=cost, **split)
