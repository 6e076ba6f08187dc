"""A streamed response: the choices' text pieces from the decode thread to server-sent events in OpenAI's chunk
format (each chunk names its choice), with their logprobs and, with tools, whole tool calls before the finish."""
from __future__ import annotations

import asyncio
import json
from typing import Optional

from . import api
from .api import Cancelled, as_api_error
from .tools import Holdback, Tools, calling

DONE = object()   # a choice's end, queued after its last piece


async def events(name: str, tok, reqs: list, rid: str, chat: bool, futs: list, q: asyncio.Queue,
                 include_usage: bool, n: int, tools: Optional[Tools]):
    """The choices' chunks as their pieces come (each chunk names its choice), a finish chunk per choice as it
    ends, then usage (when asked) and [DONE]. With tools, a choice's tool calls come whole before its finish."""
    results, left = [None] * len(reqs), len(reqs)
    sent = [[0, 0] for _ in reqs]   # per choice: logprob entries sent, characters sent (completions' offsets)
    held = [Holdback() for _ in reqs] if calling(tools) else None
    try:
        if chat:
            for i in range(len(reqs)):
                yield sse(api.chunk(True, rid, name, role=True, index=i))
        while left:
            i, item, entries = await q.get()
            if item is not DONE:
                lp = api.logprobs(chat, tok, entries, sent[i][1])
                sent[i][0] += len(entries or ())
                sent[i][1] += len(item)
                text = held[i].feed(item) if held else item
                if text or lp:
                    yield sse(api.chunk(chat, rid, name, text=text, index=i, lp=lp))
                continue
            left -= 1
            try:
                results[i] = finished(futs[i].result())
            except Exception as e:  # noqa: BLE001 - the status line is sent: report it as an event
                yield sse(as_api_error(e).body())
                yield "data: [DONE]\n\n"
                return
            rest = None if results[i].logprobs is None else results[i].logprobs[sent[i][0]:]
            text, calls = held[i].finish(tools.names) if held else (None, None)
            if text or calls:   # what the tool-call holdback kept, then the finish on its own as OpenAI sends it
                yield sse(api.chunk(chat, rid, name, text=text or None, index=i, tool_calls=calls))
            yield sse(api.chunk(chat, rid, name, text=None if chat else "", index=i,
                                 finish="tool_calls" if calls else api.FINISH[results[i].finish_reason],
                                 lp=api.logprobs(chat, tok, rest, sent[i][1]) if rest else None,
                                 extra={"swiftk": api.stats(results[i])}))
        # usage once, in OpenAI's last chunk (choices: []), and only when asked
        if include_usage:
            yield sse(api.chunk(chat, rid, name, choices=False, extra={"usage": api.usage(results, n)}))
        yield "data: [DONE]\n\n"
    finally:
        for req in reqs:
            req.cancel.set()   # normal end: no-op; client gone: decoding stops at its next token


def streamer(put, i: int, lp):
    """A streamed choice's callback: each text piece with the logprob entries of the tokens decoded since the last
    (a piece held back for a stop string or a split character comes with the tokens that complete it)."""
    sent = [0]

    def piece(text: str) -> None:
        entries = None
        if lp is not None:
            entries, sent[0] = lp.entries[sent[0]:], len(lp.entries)
        put((i, text, entries))
    return piece


def finished(result):
    if result.finish_reason == "cancelled":
        raise Cancelled
    return result


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
