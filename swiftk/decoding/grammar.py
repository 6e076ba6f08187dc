"""Constrained decoding: a grammar (JSON Schema, any JSON object, a regex or a Lark grammar, compiled by llguidance)
masks the target's scores at every position of a call, and its forced tokens are drafted for free.

Lossless to plain constrained decoding: every emitted token is the choice of the target's row with the tokens the
grammar forbids at that point set to -inf, before temperature, top-k and top-p (greedy: the masked argmax; coupled
sampling: the Gumbel-max over the allowed tokens, an exact draw from the renormalized distribution). A verify pass
is accepted along the tree one node at a time, each row masked in the grammar state its path reaches, so only the
masks of emitted tokens are computed, as plain constrained decoding computes them.

Where the grammar allows one continuation (a schema's keys, punctuation, fixed text), the forced tokens
(llguidance's fast-forward tokens) go into the round's tree as a chain of source "grammar": SGLang's jump-forward,
made lossless by verification (a forced text the model would tokenize another way is simply not accepted).
Other sources' chains are cut at their first token the grammar refuses.
"""
from __future__ import annotations

import json
from typing import Optional

import numpy as np
import torch

from ..errors import SwiftkError
from ..proposers.base import Chain

NAME = "grammar"          # the forced chain's source name (stats: accepted_by_source["grammar"])
FORCED_PROB = 0.99        # a forced token's estimated acceptance (the model may tokenize the text another way)
# JSON laid out as json.dumps does by default (no newlines or indentation): one layout, so the punctuation between
# values is forced text the grammar drafts, not whitespace the model picks token by token (a schema's "x-guidance"
# may override it)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammar:
    """A constraint for ``generate(grammar=...)``: build it with one of the constructors. It holds the grammar text
    only; each call compiles its own matcher against the model's tokenizer."""

    def __init__(self, grammar: str, what: str):
        self.text, self.what = grammar, what

    @staticmethod
    def json_schema(schema) -> "Grammar":
        """Output valid JSON for ``schema`` (a dict or its JSON text)."""
        ll = _llguidance()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise SwiftkError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise SwiftkError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        try:
            return Grammar(ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT), "json_schema")
        except (ValueError, TypeError) as e:
            raise SwiftkError(f"json_schema: {e}") from None

    @staticmethod
    def json_object() -> "Grammar":
        """Output any JSON object (OpenAI's JSON mode)."""
        return Grammar.json_schema({"type": "object"})

    @staticmethod
    def regex(pattern: str) -> "Grammar":
        if not isinstance(pattern, str) or not pattern:
            raise SwiftkError(f"regex must be a non-empty string, got {pattern!r}")
        return Grammar(_llguidance().LLMatcher.grammar_from_regex(pattern), "regex")

    @staticmethod
    def lark(text: str, what: str = "lark") -> "Grammar":
        """Output matching a Lark grammar (llguidance's dialect); ``what`` names it in a refusal."""
        if not isinstance(text, str) or not text.strip():
            raise SwiftkError("lark grammar must be a non-empty string")
        return Grammar(_llguidance().LLMatcher.grammar_from_lark(text), what)

    def matcher(self, ll_tokenizer) -> "GrammarState":
        """A fresh state of this grammar for one call (the grammar is checked here: an invalid one is refused)."""
        ll = _llguidance()
        bad, msgs = ll.LLMatcher.validate_grammar_with_warnings(self.text, ll_tokenizer)
        if bad:
            raise SwiftkError(f"{self.what} grammar is invalid: {msgs[0] if msgs else 'unknown error'}")
        return GrammarState(ll.LLMatcher(ll_tokenizer, self.text, log_level=0), ll_tokenizer.vocab_size)


class GrammarState:
    """One call's position in its grammar. It advances by every emitted token (``consume``) and masks the rows
    that choose them; it is also the forced chain's source (``propose``, ``observe``)."""

    name, learns = NAME, False

    def __init__(self, matcher, vocab_size: int):
        self.m, self.V = matcher, vocab_size

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens the grammar allows next. In numpy: torch's ops on a vocabulary-long row run
        OpenMP regions whose spinning threads then slowed the next target pass by ~20% on 2 cores."""
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return bits[: self.V].astype(bool)

    def mask(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [k, V'] (on the CPU) with what the grammar forbids next set to -inf, a copy. Ids past the
        tokenizer's vocabulary (a padded LM head) are forbidden too."""
        ok = np.zeros(rows.shape[-1], dtype=bool)
        allowed = self.allowed()
        n = min(ok.shape[0], allowed.shape[0])
        ok[:n] = allowed[:n]
        out = np.where(ok, rows.detach().cpu().float().numpy(), np.float32(-np.inf)).astype(np.float32)
        return torch.from_numpy(out).to(rows.device)

    def consume(self, tokens) -> None:
        for t in tokens:
            if not self.m.consume_token(int(t)):
                raise SwiftkError(f"grammar refused token {int(t)}: {self.m.get_error() or 'not allowed here'}")

    def valid_prefix(self, tokens: list) -> int:
        """How many leading ``tokens`` the grammar accepts from here."""
        return int(self.m.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def propose(self, k: int) -> Optional[Chain]:
        """The tokens the grammar forces next (at most ``k``), as a chain; None when it forces none."""
        if self.m.is_stopped():
            return None
        ff = self.m.compute_ff_tokens()[:k]
        return Chain(list(ff), [FORCED_PROB] * len(ff), NAME, [None] * len(ff)) if ff else None

    def observe(self, key, hit: bool) -> None:
        pass   # forced tokens are not estimated: nothing to learn

    def clip(self, chains: list) -> list:
        """Each chain cut at its first token the grammar refuses (empty ones dropped)."""
        out = []
        for c in chains:
            n = self.valid_prefix(c.tokens)
            if n == len(c.tokens):
                out.append(c)
            elif n:
                out.append(Chain(c.tokens[:n], c.probs[:n], c.source, c.keys[:n]))
        return out


def _llguidance():
    try:
        import llguidance   # lazy: the grammar engine, only for constrained calls
    except ImportError:
        raise SwiftkError("constrained decoding needs llguidance: pip install llguidance") from None
    return llguidance


class _Vocabulary:
    """A byte-level swiftk Tokenizer in the shape llguidance's TokenizerWrapper reads: every token's bytes, the
    special ids (the model's control tokens only: llguidance's reading of tokenizer.json takes every added token for
    special, so Qwen's ``<tool_call>``, plain text to the model, would be a token no grammar's text could match)."""

    def __init__(self, tokenizer, vocab_size: int):
        n = min(vocab_size, tokenizer.vocab_size)
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)] + [b""] * (vocab_size - n)
        self.special_token_ids = sorted(i for i in tokenizer.special_ids if i < vocab_size)
        self.eos_token_id = min(tokenizer.eos_ids)
        self.bos_token_id = tokenizer.bos_id
        self.encode = tokenizer.encode

    def __call__(self, text) -> list:
        return self.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text, add_bos=False)


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of a swiftk Tokenizer over the model's ``vocab_size`` logits (~1.5 s on a 150k vocabulary:
    the engine builds it once, as a resource). Byte-level vocabularies (every GGUF one) from their token bytes;
    others from their tokenizer.json, as llguidance reads it."""
    ll = _llguidance()
    if not tokenizer.eos_ids:
        raise SwiftkError("constrained decoding needs the model's end-of-sequence token; this tokenizer has none")
    src = ll.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size)) if tokenizer.byte_level else \
        tokenizer.hf_files()["tokenizer.json"]
    return ll.LLTokenizer(src, n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_ids))
