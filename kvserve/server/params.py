"""From an OpenAI request body to :class:`SamplingParams`, and the checks that come first.

Nothing here is silently dropped: a feature kvserve does not have (penalties, ``logit_bias``,
tools, ``suffix``, ``echo``) is a 400 naming the field, so a client never gets a quietly
different answer.
"""

from __future__ import annotations

import re

from kvserve.request import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, PromptTokensDetails, Usage

_SESSION_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
_PARAM_OF_MESSAGE = ("n", "max_tokens", "temperature", "top_k", "top_p", "seed", "logprobs",
                     "stop_token_ids", "stop")


def refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.presence_penalty or req.frequency_penalty:
        field = "presence_penalty" if req.presence_penalty else "frequency_penalty"
        raise APIError(400, f"{field} is not supported by kvserve; leave it unset or 0", param=field)
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported by kvserve", param="logit_bias")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise APIError(400, "suffix is not supported by kvserve", param="suffix")
        if req.echo:
            raise APIError(400, "echo is not supported by kvserve", param="echo")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, f"best_of ({req.best_of}) must equal n ({req.n}) in kvserve", param="best_of")
    else:
        if req.tools or req.tool_choice not in (None, "none"):
            raise APIError(400, "tools and tool_choice are not supported by kvserve", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format")
        for i, m in enumerate(req.messages):
            if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
                raise APIError(400, f"messages[{i}]: only text content parts are supported",
                               param=f"messages.{i}.content")


def session_id_of(body_value: str | None, header_value: str | None) -> str | None:
    """``session_id`` from the body, else the ``X-Session-Id`` header; checked for shape."""
    sid = body_value if body_value is not None else header_value
    if sid is not None and not _SESSION_ID.match(sid):
        raise APIError(400, "session_id must be 1-128 characters of letters, digits and ._:@-",
                       param="session_id")
    return sid


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                    logprobs: int | None) -> SamplingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
            max_tokens=max_tokens, stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
        )
    except ValueError as exc:
        msg = str(exc)
        param = next((p for p in _PARAM_OF_MESSAGE if msg.startswith(p)), None)
        raise APIError(400, msg, param=param) from None


def default_chat_max_tokens(prompt_tokens: int, max_model_len: int) -> int:
    """OpenAI's chat default: whatever room the context leaves."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise APIError(400, f"prompt ({prompt_tokens} tokens) leaves no room to generate within "
                            f"max_model_len ({max_model_len}); shorten the messages", param="messages")
    return room


def usage_of(outputs: list[RequestOutput]) -> Usage:
    """Prompt tokens count once per prompt (not per sample); cached tokens are prefix/session hits."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
