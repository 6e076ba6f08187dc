"""Chat templates: a model's Jinja template rendered in a sandbox, as transformers renders it, from messages in
OpenAI's shape, tool calls and tool results included.

Messages are checked before rendering, so a malformed one gets a SwiftkError naming it rather than a jinja2 error
from inside the template. An assistant's ``tool_calls`` reach the template with their ``arguments`` as objects:
OpenAI sends them as JSON text, and the templates that show calls (Qwen2.5's, Hermes') write them with ``tojson``.
"""
from __future__ import annotations

import json

from ..errors import SwiftkError

FORM = 'a list of {"role": str, "content": str} dicts'


class ChatTemplate:
    def __init__(self, text: str):
        from jinja2.sandbox import ImmutableSandboxedEnvironment   # lazy: jinja2 (~80 ms), chat templates only

        def raise_exception(msg):
            raise SwiftkError(f"chat template error: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        self.text = text
        try:
            self.template = env.from_string(text)
        except Exception as e:
            raise SwiftkError(f"cannot parse chat template: {e}") from e

    def render(self, messages, **kwargs) -> str:
        from jinja2 import TemplateError   # lazy: as above (loaded by then)

        msgs = template_messages(messages)
        try:
            return self.template.render(messages=msgs, **kwargs)
        except TemplateError as e:  # e.g. the template reads a key these messages lack
            raise SwiftkError(f"chat template error: {type(e).__name__}: {e}") from e


def template_messages(messages) -> list:
    """The messages checked and as the templates read them: content a str ("" for an assistant's message that is
    only tool calls), each call's ``arguments`` an object where its text is JSON."""
    if not isinstance(messages, (list, tuple)):
        raise SwiftkError(f"chat messages must be {FORM}, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise SwiftkError(f"chat message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        calls = m.get("tool_calls")
        if "role" not in m or ("content" not in m and not calls):
            raise SwiftkError(f"chat message {i} has no {'role' if 'role' not in m else 'content'!r}; messages "
                              f"must be {FORM}")
        m = dict(m, content="" if m.get("content") is None and calls else m.get("content"))
        for key in ("role", "content"):
            if not isinstance(m[key], str):
                raise SwiftkError(f"chat message {i}: {key!r} must be a str, got {type(m[key]).__name__}")
        if calls:
            m["tool_calls"] = [_call(c, i) for c in calls] if isinstance(calls, list) else _bad_calls(i)
        out.append(m)
    return out


def _call(c, i: int) -> dict:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        _bad_calls(i)
    args = f.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass   # not JSON: the template shows it as the text it is
    return {**c, "function": {**f, "arguments": args}}


def _bad_calls(i: int):
    raise SwiftkError(f"chat message {i}: tool_calls must be a list of "
                      '{"id", "type": "function", "function": {"name", "arguments"}}')
