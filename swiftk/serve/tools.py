"""Tool calls (OpenAI's ``tools`` / ``tool_choice``) in the Hermes format that Qwen2.5's and Hermes' chat templates
define: the model answers ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call.

- ``tool_choice="none"``: the tools are left out of the prompt (the model cannot call what it was not shown).
- ``"auto"``: the model decodes freely; blocks that parse as a call of a given tool become ``tool_calls``, the text
  before them the content. Unconstrained, so the output is the plain decoding's, with or without speculation.
- ``"required"`` / a named function: a grammar (swiftk.Grammar) admits only calls of those tools, with arguments
  valid for their ``parameters`` schema; its fixed text (the tags, keys, punctuation) is drafted for free.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional

from ..decoding.grammar import JSON_LAYOUT, Grammar
from .api import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # OpenAI's rule for function names


def template_has_tools(template: Optional[str]) -> bool:
    """Whether a chat template shows ``tools`` to the model and asks for calls in the Hermes format."""
    return bool(template) and "tools" in template and OPEN in template


def calling(tools: Optional["Tools"]) -> bool:
    """Whether the model may answer with tool calls (tools given, tool_choice not none)."""
    return tools is not None and tools.mode != "none"


@dataclass
class Tools:
    """A chat request's tools, checked: ``specs`` as the template renders them, ``mode`` none/auto/required/named."""
    specs: list
    mode: str
    named: Optional[str] = None
    parallel: bool = True

    @property
    def names(self) -> set:
        return {t["function"]["name"] for t in self.specs}

    def for_template(self) -> Optional[list]:
        return None if self.mode == "none" else self.specs

    def grammar(self) -> Optional[Grammar]:
        """The constraint of ``required`` and named choices (None: the model decodes freely)."""
        if self.mode not in ("required", "named"):
            return None
        calls, defs = [], {}
        for i, t in enumerate(self.specs):
            f = t["function"]
            if self.mode == "required" or f["name"] == self.named:
                args = _hoisted(dict(f.get("parameters") or {}), f"t{i}_", defs)
                args.setdefault("type", "object")   # a call's arguments are an object, whatever the schema omits
                calls.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": args},
                              "required": ["name", "arguments"], "additionalProperties": False})
        schema = {"anyOf": calls, "x-guidance": JSON_LAYOUT, **({"$defs": defs} if defs else {})}
        more = ' ("\\n" call)*' if self.parallel else ""
        # an invalid parameters schema shows when a call opens its matcher: the refusal names the tools
        return Grammar.lark(f'start: call{more}\ncall: "{OPEN}\\n" obj "\\n{CLOSE}"\nobj: %json {json.dumps(schema)}',
                            what="the tools' parameters")


def parse_tools(tools, tool_choice, parallel: Optional[bool], template: Optional[str]) -> Optional[Tools]:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as Tools (None: no tools), or
    APIError(400) naming what is wrong."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise _bad("tool_choice", "tool_choice needs tools")
        return None
    specs = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if isinstance(f, dict):   # a null description or strict is the field left out
            f = {k: v for k, v in f.items() if v is not None}
        if not isinstance(f, dict) or t.get("type") != "function" or set(t) - {"type", "function"}:
            raise _bad("tools", f"tools.{i} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        extra = set(f) - {"name", "description", "parameters", "strict"}
        if extra:
            raise _bad("tools", f"tools.{i}.function: unknown fields {sorted(extra)}")
        if not isinstance(f.get("name"), str) or not _NAME.fullmatch(f["name"]):
            raise _bad("tools", f"tools.{i}.function.name must be 1-64 letters, digits, _ or -, "
                       f"got {str(f.get('name'))[:80]!r}")
        if not isinstance(f.get("parameters", {}), dict) or not isinstance(f.get("description", ""), str):
            raise _bad("tools", f"tools.{i}.function: parameters must be a JSON Schema object, description a string")
        if f.get("parameters", {}).get("type", "object") != "object":
            raise _bad("tools", f"tools.{i}.function.parameters must describe an object (a call's arguments)")
        specs.append({"type": "function", "function": f})
    names = [s["function"]["name"] for s in specs]
    if len(set(names)) < len(names):
        raise _bad("tools", "tools: two tools have the same name")
    named = None
    if tool_choice is None:
        mode = "auto"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", f"tool_choice must be none, auto, required or a function, got {tool_choice!r}")
        mode = tool_choice
    else:
        f = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(f, dict) or f.get("name") not in names:
            raise _bad("tool_choice", "tool_choice must name one of the tools: "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        mode, named = "named", f["name"]
    if mode != "none" and not template_has_tools(template):
        raise _bad("tools", "this model's chat template defines no tool calls (Hermes <tool_call> format); serve it "
                          "with --chat-template FILE that does, or send tool_choice: none")
    return Tools(specs, mode, named, parallel is not False)


def split_calls(text: str, names: set) -> tuple:
    """A decoded answer -> (content or None, tool calls in OpenAI's shape or None). Calls only when every block
    parses as a call of a given tool: otherwise the whole text stays content, as the model wrote it."""
    blocks = list(_BLOCK.finditer(text))
    if not blocks or text[blocks[-1].end():].strip():
        return text, None
    calls = []
    for b in blocks:
        try:
            call = json.loads(b.group(1))
        except (ValueError, RecursionError):   # the model's text: anything, nested arbitrarily deep
            return text, None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in names \
                or not isinstance(call.get("arguments"), dict):
            return text, None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
    return text[: blocks[0].start()].rstrip() or None, calls


class Holdback:
    """A streamed answer's text with tools in play: content is passed on until a ``<tool_call>`` may be starting,
    then held (the calls go out whole once the answer ends; held text that was no call goes out as content).
    Trailing whitespace is held too, so the streamed content is the whole response's, which drops it before a call."""

    def __init__(self):
        self.sent, self.text = 0, ""

    def feed(self, piece: str) -> str:
        self.text += piece
        at = self.text.find(OPEN, self.sent)
        if at < 0:   # hold back a tail that could begin the tag
            at = len(self.text)
            for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if OPEN.startswith(self.text[-k:]):
                    at = len(self.text) - k
                    break
        at = max(self.sent, len(self.text[:at].rstrip()))
        out, self.sent = self.text[self.sent:at], at
        return out

    def finish(self, names: set) -> tuple:
        """(content still to send, tool calls or None) once the answer has ended."""
        content, calls = split_calls(self.text, names)
        if calls is None:
            return self.text[self.sent:], None
        return (content or "")[self.sent:], calls


def _hoisted(schema: dict, prefix: str, defs: dict) -> dict:
    """A tool's parameters schema placed inside the calls' schema: its ``$defs`` / ``definitions`` move to the root
    as ``defs`` under ``prefix`` (tools may name theirs alike), and its ``#/...`` references follow them."""
    for key in ("$defs", "definitions"):
        for name, d in (schema.pop(key, None) or {}).items():
            defs[prefix + name] = d

    def fix(x):
        if isinstance(x, dict):
            return {k: (_ref(v, prefix) if k == "$ref" and isinstance(v, str) else fix(v)) for k, v in x.items()}
        return [fix(v) for v in x] if isinstance(x, list) else x
    out = fix(schema)
    for name in [n for n in defs if n.startswith(prefix)]:
        defs[name] = fix(defs[name])
    return out


def _ref(ref: str, prefix: str) -> str:
    for key in ("#/$defs/", "#/definitions/"):
        if ref.startswith(key):
            return "#/$defs/" + prefix + ref[len(key):]
    return ref


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)
