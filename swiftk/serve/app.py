"""The HTTP server: routes, continuous batching on the engine, streaming, cancellation and shutdown.

Requests decode together on one decode thread (swiftk.scheduler.Scheduler): up to ``max_batch`` at once, every round
of all of them in one target pass, a request joining or leaving between rounds; at most ``queue_size`` more wait for
a free slot (beyond that HTTP 429 with Retry-After). A response's tokens do not depend on what else decodes beside
it. The event loop only parses, validates and tokenizes, so a bad request is answered at once while the engine
decodes. A client that goes away sets its request's cancel event: it leaves the batch at its next token.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .. import methods
from ..options import split_options, updated
from ..errors import SwiftkError
from ..decoding.output import check_lengths
from ..requests import Request as EngineRequest, check_max_batch
from . import api
from .api import APIError, Cancelled, as_api_error
from .decode import DecodeThread
from .stream import DONE, events, finished, streamer
from .tools import Tools, calling, parse_tools, split_calls

log = logging.getLogger("swiftk.serve")
HISTORY_SCOPES = ("server", "key")
MAX_BODY = 8 << 20          # bytes; a request is a prompt, not an upload
MAX_STOP = 4                # OpenAI's limit on stop sequences


class Server:
    """One engine behind OpenAI's completions and chat-completions endpoints.

    ``history_scope``: "server" shares the engine's learned state (and the session history it drafts from)
    across all requests; "key" keeps one learned state per API key, so no client's output drafts (and speeds up)
    another key's responses, and prefills every prompt whole (no prefix_cache). ``options``: decode options applied
    to every request (options.DecodeConfig). ``max_batch``: requests decoding together (default: the engine's
    ``default_max_batch``, sized to the machine); ``queue_size``: requests waiting beyond those. ``chat_template``:
    a Jinja chat template that replaces the model's (the server owns its engine), e.g. one that defines tools.
    """

    def __init__(self, engine, model_name: str, api_keys: Sequence[str] = (), history_scope: str = "server",
                 queue_size: int = 16, method: Optional[str] = None, options: Optional[dict] = None,
                 max_batch: Optional[int] = None, allowed_origins: Sequence[str] = (),
                 chat_template: Optional[str] = None):
        if history_scope not in HISTORY_SCOPES:
            raise SwiftkError(f"history_scope must be one of {HISTORY_SCOPES}, got {history_scope!r}")
        if history_scope == "key" and not api_keys:
            raise SwiftkError("history_scope='key' needs at least one API key (--api-key)")
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 0:
            raise SwiftkError(f"queue_size must be an int >= 0, got {queue_size!r}")
        max_batch = check_max_batch(engine.slots.default_max_batch() if max_batch is None else max_batch)
        if any(not isinstance(k, str) or not k or k != k.strip() for k in api_keys):
            raise SwiftkError("an API key must be a non-empty string without surrounding spaces")
        self.allowed_origins = check_origins(allowed_origins)
        if chat_template is not None:
            if not isinstance(chat_template, str) or not chat_template.strip():
                raise SwiftkError("chat_template must be a non-empty Jinja template")
            engine.tokenizer.chat_template = chat_template
            engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])   # a broken one fails here
        method = engine.default_method if method is None else method   # "draft_model" with a draft model loaded
        m = methods.get(method)
        split, opt = split_options(dict(options or {}))
        if opt:
            raise SwiftkError(f"{', '.join(sorted(opt))}: optimizer options belong to the engine (swiftk.load)")
        cfg = updated(engine.decode_config, split)   # a bad decode option fails here, not on every request
        if m.speculative:   # the method's own checks and what it builds once, here rather than in every request
            m.prepare(engine.target, cfg)
        if history_scope == "key" and split.get("prefix_cache") is True:
            raise SwiftkError("prefix_cache=True with history_scope='key': a key's prefill time would show what its "
                              "prompt shares with another key's conversation")
        self.engine, self.model_name, self.method = engine, model_name, method
        self.api_keys = list(api_keys)
        # key scope: no prompt reuses the KV another key's request left (its speed would tell what they share)
        self.options = dict(options or {}, **({"prefix_cache": False} if history_scope == "key" else {}))
        self.states = {k: engine.new_state() for k in api_keys} if history_scope == "key" else {}
        self.created = int(time.time())
        self.decoder = DecodeThread(engine, max_batch, queue_size)   # last: it starts the decode thread

    # ------------------------------------------------------------------ app
    def app(self) -> FastAPI:
        app = FastAPI(title="swiftk", docs_url=None, redoc_url=None, openapi_url=None)
        if self.allowed_origins:   # browsers may call from these origins (preflight OPTIONS answered); off by default
            app.add_middleware(CORSMiddleware, allow_origins=self.allowed_origins, allow_methods=["GET", "POST"],
                               allow_headers=["Authorization", "Content-Type"], max_age=600)

        @app.exception_handler(HTTPException)
        async def http_error(request, exc):   # unknown route, wrong method: OpenAI's error shape too
            return _error_response(APIError(exc.status_code, str(exc.detail)))

        @app.get("/health")
        async def health():
            q = self.decoder
            return {"status": "closing" if q.closing else "ok", "model": self.model_name, "running": q.running,
                    "max_batch": q.max_batch, "waiting": q.waiting, "served": q.served, "cancelled": q.cancelled}

        @app.get("/v1/models")
        async def models(request: Request):
            return await guard(request, lambda key: {"object": "list", "data": [self._model_card()]})

        @app.get("/v1/models/{model_id:path}")
        async def model(request: Request, model_id: str):
            def card(key):
                if model_id != self.model_name:
                    raise APIError(404, f"model {model_id!r} is not served here", code="model_not_found")
                return self._model_card()
            return await guard(request, card)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._handle(request, chat=True)

        async def guard(request, fn):
            try:
                return JSONResponse(fn(self._authorize(request)))
            except APIError as e:
                return _error_response(e)

        return app

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "swiftk"}

    # ------------------------------------------------------------------ requests
    async def _handle(self, request, chat: bool):
        try:
            key = self._authorize(request)
            req = api.parse(api.ChatRequest if chat else api.CompletionRequest, await _read_json(request))
            n = req.n or 1
            tools, grammar = self._constraints(req, chat)
            reqs = [self._request(req, chat, key, ids, j, grammar) for ids in self._prompts(req, chat, tools)
                    for j in range(n)]
            rid = api.new_id("chatcmpl" if chat else "cmpl")
            if req.stream:
                loop, q = asyncio.get_running_loop(), asyncio.Queue()

                def put(item):
                    try:
                        loop.call_soon_threadsafe(q.put_nowait, item)
                    except RuntimeError:   # the loop is closed: the server is gone
                        pass

                for i, r in enumerate(reqs):
                    r.callback = streamer(put, i, r.logprobs)
                futs = self.decoder.submit_many(reqs)
                for i, fut in enumerate(futs):
                    fut.add_done_callback(lambda f, i=i: put((i, DONE, None)))
                usage = bool(req.stream_options and req.stream_options.include_usage)
                stream = events(self.model_name, self.engine.tokenizer, reqs, rid, chat, futs, q, usage, n, tools)
                return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            futs = [asyncio.wrap_future(f) for f in self.decoder.submit_many(reqs)]
            while not all(f.done() for f in futs):
                await asyncio.wait(futs, timeout=0.2, return_when=asyncio.ALL_COMPLETED)
                if not all(f.done() for f in futs) and await request.is_disconnected():
                    for r in reqs:   # the client is gone: free the engine at the next token
                        r.cancel.set()
            results = [finished(f.result()) for f in futs]
            calls = [split_calls(r.text, tools.names) for r in results] if calling(tools) else None
            return JSONResponse(api.response(chat, rid, self.model_name, results, n,
                                             self.engine.tokenizer, calls))
        except Exception as e:  # noqa: BLE001 - every failure is answered in OpenAI's shape
            return _error_response(as_api_error(e))

    def _authorize(self, request) -> Optional[str]:
        if not self.api_keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        for k in self.api_keys:
            if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), k.encode()):
                return k
        raise APIError(401, "a valid API key is required (header Authorization: Bearer KEY)", code="invalid_api_key")

    def _constraints(self, req, chat: bool) -> tuple:
        """(the chat request's Tools or None, the grammar its output must match or None), each built once per
        request: the tools' grammar (tool_choice required or a named function), or response_format's."""
        tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                            self.engine.tokenizer.chat_template) if chat else None
        grammar = api.grammar_of(req)
        if calling(tools) and grammar is not None:
            raise APIError(400, "response_format shapes a message's content; with tools the answer may be tool calls "
                           "instead: send one or the other (or tool_choice: none)", param="response_format")
        return tools, grammar if grammar is not None or tools is None else tools.grammar()

    def _request(self, req, chat: bool, key: Optional[str], ids: list, choice: int, grammar) -> EngineRequest:
        """The engine's Request for one choice of an HTTP request: OpenAI's defaults and errors (with the parameter
        they name) first, then the engine's own checks; all before it queues, so a bad one never waits for the
        engine. ``choice``: which of the prompt's ``n`` choices (a seed gives choice j the seed + j: n equal draws
        would be one)."""
        room = self.engine.max_context - len(ids)
        limit = getattr(req, "max_completion_tokens", None)
        param = "max_completion_tokens" if limit is not None else "max_tokens"
        limit = limit if limit is not None else req.max_tokens
        if limit is None:   # OpenAI's defaults: 16 for completions, the rest of the context for chat
            if room < 1:   # the prompt alone fills the context: the code clients trim their history on
                raise APIError(400, f"the prompt is {len(ids)} tokens; this model's context is "
                               f"{self.engine.max_context} tokens", param="messages" if chat else "prompt",
                               code="context_length_exceeded")
            limit = 16 if not chat else room
        if limit < 1:
            raise APIError(400, f"{param} must be >= 1, got {limit}", param=param)
        try:
            check_lengths(len(ids), limit, self.engine.max_context, self.engine.config.max_position)
        except SwiftkError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        t = 1.0 if req.temperature is None else req.temperature
        if not 0.0 <= t <= 2.0:
            raise APIError(400, f"temperature must be in [0, 2], got {t}", param="temperature")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP:
            raise APIError(400, f"at most {MAX_STOP} stop sequences, got {len(stop)}", param="stop")
        # what only the engine knows to refuse (top_p's range, a method's options) is a SwiftkError: a 400
        # (api.as_api_error), raised before anything queues
        return self.engine.calls.request(ids, max_new_tokens=limit, method=self.method, stop=stop,
                                   state=self.states.get(key), logprobs=api.logprobs_asked(req), grammar=grammar,
                                   temperature=t, top_p=1.0 if req.top_p is None else req.top_p,
                                   top_k=req.top_k or 0, seed=None if req.seed is None else req.seed + choice,
                                   **self.options)

    def _prompts(self, req, chat: bool, tools: Optional[Tools] = None) -> list:
        """The request's prompts as token ids: a chat's one, or a completion's (a string, token ids, or a list of
        either: several prompts, decoded together)."""
        if req.model != self.model_name:   # 404 as OpenAI answers it: clients raise NotFoundError
            raise APIError(404, f"model {req.model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        eng = self.engine
        try:
            if chat:
                msgs = [{"role": "system" if m.role == "developer" else m.role,
                         "content": "".join(p.text for p in m.content) if isinstance(m.content, list) else m.content,
                         **({"tool_calls": [c.model_dump() for c in m.tool_calls]} if m.tool_calls else {}),
                         **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})} for m in req.messages]
                if not msgs:
                    raise APIError(400, "messages is empty", param="messages")
                return [eng.encode_prompt(msgs, chat=True, tools=tools.for_template() if tools else None)]
            p = req.prompt
            many = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
            if len(many) * (req.n or 1) > api.MAX_CHOICES:
                raise APIError(400, f"{len(many)} prompts x n={req.n or 1} choices: at most {api.MAX_CHOICES} in one "
                               "request", param="prompt")
            return [eng.encode_prompt(x) for x in many]
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - a template may raise anything on odd message orders
            raise APIError(400, f"{'messages' if chat else 'prompt'}: {e}",
                           param="messages" if chat else "prompt") from None


def check_origins(origins: Sequence[str]) -> list:
    """``--allowed-origins``: "*" or origins as browsers send them (scheme://host[:port], no path)."""
    out = []
    for o in origins:
        if not isinstance(o, str) or not (o == "*" or re.fullmatch(r"https?://[^/\s]+", o)):
            raise SwiftkError(f"allowed origin {o!r}: use '*' or scheme://host[:port], e.g. http://localhost:3000")
        out.append(o)
    return out


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _read_json(request):
    """The body as JSON, read up to MAX_BODY bytes (a larger body is refused before it is buffered)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise APIError(413, f"request body over {MAX_BODY >> 20} MiB")
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY:
                raise APIError(413, f"request body over {MAX_BODY >> 20} MiB")
    except ClientDisconnect:
        raise Cancelled from None   # nobody is left to answer
    try:
        return json.loads(body)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None


def serve(engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          **server_options) -> None:
    """Serve until SIGINT/SIGTERM: then stop accepting, cancel the queued and running requests and exit."""
    import uvicorn   # lazy: only serve() runs a server; the app itself (and its tests) needs just fastapi

    srv = Server(engine, model_name, **server_options)

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):
            srv.decoder.close()   # in-flight decodes end at their next token, so the graceful wait is short
            super().handle_exit(sig, frame)

    config = uvicorn.Config(srv.app(), host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=5)
    try:
        _Uvicorn(config).run()
    finally:
        srv.decoder.close()
