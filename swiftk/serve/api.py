"""The OpenAI request bodies swiftk accepts, and the responses and errors it answers, as plain data.

Every field of OpenAI's completions and chat-completions requests is applied, accepted as a no-op where it asks
nothing of the output (``store``, ``metadata``, ``user``...), or refused with HTTP 400 naming it (penalties,
``logit_bias``, ``best_of``...: UNSUPPORTED); unknown fields are refused too (``extra="forbid"``), so a client never
gets an answer that silently ignored what it asked for.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from ..decoding.grammar import Grammar
from ..errors import SwiftkError

log = logging.getLogger("swiftk.serve")
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's limit; swiftk.decoding.output.MAX_LOGPROBS)
MAX_CHOICES = 64   # choices in one request (prompts x n): each is a request of the batch


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        default = "invalid_request_error" if status < 500 else "server_error"
        self.type = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                     503: "service_unavailable"}.get(status, default)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Cancelled(Exception):
    """The job was cancelled before or while decoding (client gone, or the server shutting down)."""


class _Strict(BaseModel):
    # one policy for every field: no coercion ("0" is not a number, 1.0 not an int, true not 1) and no unknown keys
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    include_obfuscation: Optional[StrictBool] = None   # no-op: swiftk pads no chunk


class _Common(_Strict):
    model: StrictStr
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None          # extension, as in vLLM and llama.cpp's server
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, List[StrictStr], None] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[StrictInt] = None             # choices per prompt, each decoded as a request of the batch
    # accepted only at their no-op values (see UNSUPPORTED)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    # no-ops: they ask nothing of the output (storage, tags, routing and cache hints, end-user ids)
    user: Optional[StrictStr] = None
    safety_identifier: Optional[StrictStr] = None
    store: Optional[StrictBool] = None
    metadata: Optional[dict] = None
    service_tier: Optional[StrictStr] = None
    prompt_cache_key: Optional[StrictStr] = None


class CompletionRequest(_Common):
    prompt: Union[StrictStr, List[StrictStr], List[StrictInt], List[List[StrictInt]]]
    echo: Optional[bool] = None
    logprobs: Optional[StrictInt] = None       # alternatives per token (0: the chosen token's alone)
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr   # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"]
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]   # developer: OpenAI's newer name for system
    content: Union[StrictStr, List[TextPart], None] = None   # None: only an assistant's message of tool calls
    name: Optional[StrictStr] = None   # a participant's name: the chat templates have no place for it
    tool_calls: Optional[List[ToolCall]] = None    # an assistant's earlier calls
    tool_call_id: Optional[StrictStr] = None       # a tool's answer: the call it answers
    # what an assistant message echoed back from a response carries (``message.model_dump()``), at its empty value
    refusal: Optional[StrictStr] = None
    function_call: Optional[dict] = None
    audio: Optional[dict] = None
    annotations: Optional[list] = None


class ChatRequest(_Common):
    messages: List[Message]
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list] = None                        # checked by serve.tools.parse_tools
    tool_choice: Optional[Union[StrictStr, dict]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    response_format: Optional[dict] = None


# field -> the values that mean "not asked for"; anything else is refused by name
UNSUPPORTED = {"presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "logit_bias": (None, {}), "echo": (None, False),
               "best_of": (None, 1), "suffix": (None, "")}


def parse(model: type, raw) -> _Common:
    """The request body as ``model``, or APIError(400) naming the first bad or unsupported field."""
    if not isinstance(raw, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        what = "unknown field (not in OpenAI's API or not supported by swiftk)" if err["type"] == "extra_forbidden" \
            else err["msg"]
        raise APIError(400, f"{loc}: {what}", param=loc) from None
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed with stream: true", param="stream_options")
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise APIError(400, f"n must be in 1..{MAX_CHOICES}, got {req.n}", param="n")
    for name, ok in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if value not in ok:
            raise APIError(400, f"{name}={value!r} is not supported by swiftk", param=name, code="unsupported")
    top = logprobs_asked(req)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        name = "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"
        raise APIError(400, f"{name} must be in 0..{MAX_LOGPROBS}, got {top}", param=name)
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    for i, m in enumerate(getattr(req, "messages", None) or []):
        for name in ("function_call", "audio"):   # an echoed message's empty fields pass; content not
            if getattr(m, name) not in (None, [], {}):
                raise APIError(400, f"messages.{i}.{name}: the legacy function_call and audio are not supported by "
                               "swiftk (use tool_calls)", param=f"messages.{i}.{name}", code="unsupported")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(400, f"messages.{i}.content is required (only an assistant's tool calls may omit it)",
                           param=f"messages.{i}.content")
        if (m.role == "tool") != (m.tool_call_id is not None) or (m.tool_calls and m.role != "assistant"):
            raise APIError(400, f"messages.{i}: tool_call_id belongs to (and is required in) a tool's message, "
                           "tool_calls to an assistant's", param=f"messages.{i}")
    return req


def grammar_of(req):
    """The swiftk.Grammar a chat request's ``response_format`` asks for (None: free text), or APIError(400)."""
    rf = getattr(req, "response_format", None)
    if rf is None or rf == {"type": "text"}:
        return None
    kind = rf.get("type")
    try:
        if kind == "json_object" and set(rf) == {"type"}:
            return Grammar.json_object()
        if kind == "json_schema" and set(rf) == {"type", "json_schema"} and isinstance(rf["json_schema"], dict):
            js = rf["json_schema"]
            extra = set(js) - {"name", "schema", "strict", "description"}
            if extra or "schema" not in js:
                raise SwiftkError("json_schema must hold 'schema' (and may hold name, description, strict)"
                                  + (f"; unknown: {sorted(extra)}" if extra else ""))
            return Grammar.json_schema(js["schema"])
    except SwiftkError as e:
        raise APIError(400, f"response_format: {e}", param="response_format") from None
    raise APIError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                   "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                   param="response_format")


def logprobs_asked(req) -> Optional[int]:
    """Alternatives per token the request asks for, or None when it asks for no logprobs."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def logprobs(chat: bool, tok, entries: Optional[list], offset: int = 0) -> Optional[dict]:
    """Engine logprob entries (decoding.output.TokenLogprobs) in OpenAI's shape: chat's ``content`` list, or the
    completions' parallel lists (``offset``: characters of the text before these tokens)."""
    if entries is None:
        return None
    text = lambda i: tok.token_bytes(i).decode("utf-8", "replace")   # noqa: E731
    if chat:
        return {"content": [{"token": text(e["token_id"]), "logprob": e["logprob"],
                             "bytes": list(tok.token_bytes(e["token_id"])),
                             "top_logprobs": [{"token": text(i), "logprob": lp, "bytes": list(tok.token_bytes(i))}
                                              for i, lp in e["top"]]} for e in entries], "refusal": None}
    tokens, offsets = [text(e["token_id"]) for e in entries], []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{text(i): lp for i, lp in e["top"]} for e in entries], "text_offset": offsets}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(results: list, n: int = 1) -> dict:
    """OpenAI's usage of one response's choices (``n`` per prompt): each prompt counted once, every choice's
    completion; ``cached_tokens``: prompt tokens whose KV an earlier call left (not prefilled again)."""
    firsts = results[::n]
    p, c = sum(len(r.prompt_ids) for r in firsts), sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(int(r.stats.prompt_reused) for r in firsts)}}


def stats(result) -> dict:
    """swiftk's own numbers for one response (the ``swiftk`` extension field)."""
    s = result.stats
    return {"method": s.method, "tokens_per_s": round(s.tokens_per_s, 3) if s.new_tokens else 0.0,
            "mean_accepted_length": round(s.mean_accepted_length, 3),
            "acceptance_rate": round(s.acceptance_rate, 4), "decoding_steps": s.decoding_steps,
            "prompt_reused": s.prompt_reused, "shared_passes": s.shared_passes,
            "accepted_by_source": dict(s.accepted_by_source), "wall_time_s": round(s.wall_time_s, 4),
            "queue_time_s": round(s.queue_time_s, 4)}


def response(chat: bool, rid: str, model: str, results: list, n: int = 1, tok=None,
             calls: Optional[list] = None) -> dict:
    """A whole (non-streamed) response: one choice per result, in order (prompt i's choice j is index i * n + j);
    ``calls``: per result, its (content, tool calls) when tools are in play. ``swiftk`` holds the first choice's
    statistics, ``swiftk_choices`` every choice's when there are several."""
    choices = []
    for i, result in enumerate(results):
        content, tool_calls = calls[i] if calls else (result.text, None)
        choice = {"index": i, "finish_reason": "tool_calls" if tool_calls else FINISH[result.finish_reason],
                  "logprobs": logprobs(chat, tok, result.logprobs)}
        if chat:
            choice["message"] = {"role": "assistant", "content": content, **({"tool_calls": tool_calls}
                                                                               if tool_calls else {})}
        else:
            choice["text"] = result.text
        choices.append(choice)
    out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": choices, "usage": usage(results, n), "swiftk": stats(results[0])}
    if len(results) > 1:
        out["swiftk_choices"] = [stats(r) for r in results]
    return out


def chunk(chat: bool, rid: str, model: str, text: Optional[str] = None, finish: Optional[str] = None,
          role: bool = False, extra: Optional[dict] = None, choices: bool = True, index: int = 0,
          lp: Optional[dict] = None, tool_calls: Optional[list] = None) -> dict:
    """One server-sent event of a stream, in OpenAI's chunk format (``index``: the choice it belongs to; ``lp``:
    the logprobs of the tokens it brings, in OpenAI's shape; ``tool_calls``: whole calls, each its own delta)."""
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        if tool_calls:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": lp}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice] if choices else [], **(extra or {})}


def as_api_error(e: Exception) -> APIError:
    """Any failure of a request as the error answered to its client (an unexpected one is logged, as a 500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, Cancelled):
        return APIError(503, "the request was cancelled: the server is shutting down", code="cancelled")
    if isinstance(e, SwiftkError):
        return APIError(400, str(e))
    log.exception("swiftk serve: request failed", exc_info=e)
    return APIError(500, f"internal error ({type(e).__name__}); the server keeps serving")
