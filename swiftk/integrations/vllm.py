"""swiftk's free draft sources as vLLM's speculative proposer (``method="custom_class"``), for when one machine or one
user at a time is not enough: vLLM does tensor/pipeline parallelism, batching and paged KV; swiftk drafts.

    LLM(model=..., speculative_config={"method": "custom_class", "num_speculative_tokens": 8,
                                       "model": "swiftk.integrations.vllm.SwiftkProposer"})

Per request: the context suffix automaton (extended with each step's new tokens, never rebuilt), the outputs of
earlier requests (one history shared by every request of the engine), the corpus n-grams, and user proposers named
in the options. Each source prices its guesses with acceptance estimates learned from what vLLM accepted; the
proposer returns the chain with the most expected accepted tokens, cut where a token's chance of being reached
falls below the floor: what one more verified token costs, measured from vLLM's step times (StepCosts). A chain
whose first token is not expected to pay is still sent now and then (a probe, with a doubling gap), which is how
an estimate learns that the text changed. vLLM verifies every draft token: output is the target's whatever is
proposed.

vLLM's hook passes no request ids, only batch rows: a row's state is matched to its request by the request's first
and latest tokens, and follows it when vLLM moves it to another row; a state whose request left the batch is freed
and its output joins the history. Options: the class attribute ``options`` (subclass and name your class) or the
environment variable SWIFTK_VLLM_OPTIONS (JSON), see ``OPTIONS``. This module does not import vLLM.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import weakref
from typing import Optional

from ..background import Background
from ..errors import SwiftkError
from ..loading.tokenizer import Tokenizer
from ..proposers.base import Context
from ..proposers.datastore import cached_stdlib_datastore, corpus_fingerprint, engine_corpus
from ..proposers.user import UserProposer
from .batch import Drafter

log = logging.getLogger("swiftk.vllm")

ENV = "SWIFTK_VLLM_OPTIONS"
SOURCES = ("ngram", "history", "datastore")
OPTIONS = {   # name: (default, what it is)
    "sources": (list(SOURCES), "built-in sources to draft from: any of ngram, history, datastore"),
    "proposers": ([], "user proposers as 'module:attribute' (a class or factory called with no arguments whose "
                      "result has propose(tokens) -> list[int])"),
    "floor": ("auto", "a draft token is sent while its chance of being reached is >= floor (0 <= floor < 1); "
                      "auto: what one more verified token costs, measured from vLLM's step times"),
    "history_tokens": (32768, "tokens of earlier outputs kept for the history source (>= 2)"),
    "context_tokens": (16384, "tokens of one request's context indexed at most (its latest ones; >= 256)"),
    "probe_gap": (64, "longest gap, in steps, between probes of a declined request (>= 1)"),
}


def parse_options(base: Optional[dict] = None, env: Optional[str] = None) -> dict:
    """The options: defaults, then ``base`` (the class's), then ``env`` (JSON). Unknown names and bad values are a
    SwiftkError naming them."""
    out = {k: v[0] for k, v in OPTIONS.items()}
    for where, extra in (("options", base), (ENV, env)):
        if extra is None or extra == "":
            continue
        if isinstance(extra, str):
            try:
                extra = json.loads(extra)
            except json.JSONDecodeError as e:
                raise SwiftkError(f"{where} is not valid JSON: {e}") from None
        if not isinstance(extra, dict):
            raise SwiftkError(f"{where} must be a JSON object of options, got {type(extra).__name__}")
        unknown = sorted(set(extra) - set(OPTIONS))
        if unknown:
            raise SwiftkError(f"{where}: unknown option {unknown[0]!r}; known: {', '.join(OPTIONS)}")
        out.update(extra)
    src = out["sources"]
    if not isinstance(src, list) or any(s not in SOURCES for s in src):
        raise SwiftkError(f"option sources must be a list of {', '.join(SOURCES)}, got {src!r}")
    if not isinstance(out["proposers"], list) or any(not isinstance(p, str) for p in out["proposers"]):
        raise SwiftkError(f"option proposers must be a list of 'module:attribute' strings, got {out['proposers']!r}")
    f = out["floor"]
    if f != "auto" and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1):
        raise SwiftkError(f"option floor must be \"auto\" or a number in [0, 1), got {f!r}")
    # context_tokens >= 256: a trim keeps half, more than one step's new tokens (at most MAX_K + 1)
    for name, lo in (("history_tokens", 2), ("context_tokens", 256), ("probe_gap", 1)):
        v = out[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise SwiftkError(f"option {name} must be an integer >= {lo}, got {v!r}")
    return out


def load_proposer(path: str):
    """'module:attribute' -> the user proposer object (the attribute called with no arguments)."""
    mod, sep, attr = path.partition(":")
    if not sep or not mod or not attr:
        raise SwiftkError(f"proposer {path!r}: name it as 'module:attribute'")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except ImportError as e:
        raise SwiftkError(f"proposer {path!r}: cannot import {mod!r} ({e})") from None
    except AttributeError:
        raise SwiftkError(f"proposer {path!r}: module {mod!r} has no attribute {attr!r}") from None
    try:
        inst = obj()
    except Exception as e:  # noqa: BLE001 - a user's constructor: named at startup
        raise SwiftkError(f"proposer {path!r}: constructing it raised {type(e).__name__}: {e}") from e
    UserProposer.check(inst)
    return inst


def _tokenizer(path):
    """swiftk's tokenizer of a local Hugging Face directory, or None (a hub name, no tokenizer.json)."""
    try:
        return Tokenizer.from_hf_dir(path) if path and os.path.isdir(path) else None
    except SwiftkError as e:
        log.warning("swiftk: no tokenizer for the corpus (%s)", e)
        return None


class SwiftkProposer:
    """vLLM's ``custom_class`` proposer: ``SwiftkProposer(vllm_config)``, then ``propose(...)`` every step."""

    options: dict = {}   # a subclass's options (OPTIONS), under SWIFTK_VLLM_OPTIONS's
    instances: "weakref.WeakSet" = weakref.WeakSet()   # live proposers of this process: their drafter.stats

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        mc = vllm_config.model_config
        opts = parse_options(type(self).options, os.environ.get(ENV))
        user, taken = [], {"root", "draft", *SOURCES}
        for path in opts["proposers"]:   # outcomes go back to each by name: names made unique ("Name#2")
            obj = load_proposer(path)
            base = getattr(obj, "name", None) or type(obj).__name__
            name, n = base, 1
            while name in taken:
                n += 1
                name = f"{base}#{n}"
            taken.add(name)
            user.append((name, obj))
        vocab = int(mc.get_vocab_size())
        for name, obj in user:   # a proposer that fails on a sequence fails here, at startup, not in a worker
            try:
                UserProposer(obj, vocab, name).propose(Context([0, 1, 2, 3], 4, 0.0))
            except SwiftkError as e:
                raise SwiftkError(f"{e} (checked at startup on the token ids [0, 1, 2, 3])") from None
        self.drafter = Drafter(spec.num_speculative_tokens, vocab, mc.max_model_len, opts, user=user)
        SwiftkProposer.instances.add(self)
        if "datastore" in opts["sources"]:
            self._start_corpus(getattr(mc, "tokenizer", None) or mc.model, vocab)

    def _start_corpus(self, path, vocab: int) -> None:
        """Corpus tables from $SWIFTK_HOME when cached, else built on a background thread: nothing slow at
        startup or in a step; requests draft from the corpus once it is ready."""
        tok = _tokenizer(path)
        if tok is None:
            log.warning("swiftk: corpus n-grams off: %r is not a local directory with tokenizer.json", path)
            return
        ident = {"fingerprint": tok.fingerprint()}
        ds = cached_stdlib_datastore(corpus_fingerprint(tok, ident), vocab)
        if ds is not None:
            self.drafter.set_corpus(ds)
            return

        def build():
            ds, why = engine_corpus(tok, ident, vocab)
            if why:
                log.warning(why)
            else:
                self.drafter.set_corpus(ds)

        Background(build, name="swiftk-corpus", low_priority=True)   # serving goes first

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's runners call this on every proposer; there is no model to load."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list:
        return self.drafter.step(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)

