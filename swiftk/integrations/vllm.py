"""swiftk's free draft sources as vLLM's speculative proposer (``method="custom_class"``), for when one machine or one
user at a time is not enough: vLLM does tensor/pipeline parallelism, batching and paged KV; swiftk drafts.

    LLM(model=..., speculative_config={"method": "custom_class", "num_speculative_tokens": 8,
                                       "model": "swiftk.integrations.vllm.SwiftkProposer"})

Per request: the context suffix automaton (extended with each step's new tokens, never rebuilt), the outputs of
earlier requests (one history shared by every request of the engine), the corpus n-grams, and user proposers named
in the options. Each source prices its guesses with acceptance estimates learned from what vLLM accepted; the
proposer returns the chain with the most expected accepted tokens, cut where a token's chance of being reached
falls below ``floor`` (the share of a decode step one more verified token costs). A chain whose first token is not
expected to pay is still sent now and then (a probe, with a doubling gap), which is how an estimate learns that the
text changed. vLLM verifies every draft token: output is the target's whatever is proposed.

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
import threading
import weakref
from typing import Optional

from ..errors import SwiftkError
from ..proposers.base import Context, Estimates
from ..proposers.context import ContextNgrams
from ..proposers.corpus import CorpusNgrams
from ..proposers.history import SessionHistory
from ..proposers.user import UserProposer
from ..suffix import OutputHistory

log = logging.getLogger("swiftk.vllm")

ENV = "SWIFTK_VLLM_OPTIONS"
SOURCES = ("ngram", "history", "datastore")
MAX_K = 64
OPTIONS = {   # name: (default, what it is)
    "sources": (list(SOURCES), "built-in sources to draft from: any of ngram, history, datastore"),
    "proposers": ([], "user proposers as 'module:attribute' (a class or factory called with no arguments whose "
                      "result has propose(tokens) -> list[int])"),
    "floor": (0.1, "a draft token is sent while its chance of being reached is >= floor (0 <= floor < 1)"),
    "history_tokens": (32768, "tokens of earlier outputs kept for the history source (>= 2)"),
    "context_tokens": (16384, "tokens of one request's context indexed at most (its latest ones; >= 256)"),
    "probe_gap": (64, "longest gap, in steps, between probes of a declined request (>= 1)"),
}
_SIG = 16   # tokens at each end of a request that identify it across steps


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
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
        raise SwiftkError(f"option floor must be a number in [0, 1), got {f!r}")
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


class _Request:
    """One request's drafting state: its latest tokens (at most ``context_tokens``), their automaton, its walk over
    the history, its sources."""

    def __init__(self, tokens: list, n_new: int, drafter: "Drafter"):
        d = drafter
        self.drafter = d
        self.head = tokens[:_SIG]
        self.prompt_len = len(tokens) - n_new   # what came before its first sampled token
        self.offset = 0                         # tokens dropped from the front (bounded memory)
        self.last = None                        # (chain, position, source) of the draft sent last step
        self.gap, self.wait = 1, 0              # probes of a declined request: the gap doubles per miss
        self.fixed = []                         # sources that keep no per-token state: corpus, user proposers
        if "datastore" in d.opts["sources"] and d.corpus is not None:
            self.fixed.append(CorpusNgrams(d.corpus, d.est["datastore"]))
        self.fixed += [UserProposer(obj, d.vocab_size, name) for name, obj in d.user]
        self._index(tokens)

    def _index(self, tokens: list) -> None:
        """The sources over this request's tokens, fresh (they extend themselves from ``tokens`` as it grows)."""
        d = self.drafter
        self.tokens = tokens
        self.srcs = []
        if "ngram" in d.opts["sources"]:
            self.srcs.append(ContextNgrams(d.est["ngram"]))
        if "history" in d.opts["sources"]:
            self.srcs.append(SessionHistory(d.history, d.est["history"]))
        self.srcs += self.fixed

    def length(self) -> int:
        return self.offset + len(self.tokens)

    def matches(self, row, n: int) -> bool:
        """Whether batch row ``row`` (its first ``n`` tokens) holds this request."""
        m = self.length()
        if n < m:
            return False
        head = len(self.head)
        tail = min(_SIG, len(self.tokens))
        return (list(row[:head]) == self.head
                and list(row[m - tail:m]) == self.tokens[len(self.tokens) - tail:])

    def extend(self, new: list) -> None:
        self.tokens.extend(new)
        cap = self.drafter.opts["context_tokens"]
        if len(self.tokens) > cap:   # keep the latest half: new automata over it (amortised O(1) per token)
            keep = self.tokens[-(cap // 2):]
            self.offset += len(self.tokens) - len(keep)
            self._index(keep)

    def output(self) -> list:
        start = max(self.prompt_len - self.offset, 0)
        return self.tokens[start:]


class Drafter:
    """The batch drafter behind SwiftkProposer, independent of vLLM: ``step(sampled, num_tokens, token_ids)`` with
    vLLM's arguments returns one draft (list of token ids) per row."""

    def __init__(self, k: int, vocab_size: int, max_model_len: int, opts: dict, corpus=None, user=()):
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise SwiftkError(f"num_speculative_tokens must be an integer in [1, {MAX_K}], got {k!r}")
        self.k, self.vocab_size, self.max_model_len, self.opts = k, int(vocab_size), int(max_model_len), opts
        self.history = OutputHistory(opts["history_tokens"])
        self.est = {"ngram": ContextNgrams.new_estimates(), "history": SessionHistory.new_estimates(),
                    "datastore": CorpusNgrams.new_estimates()}
        self.corpus = corpus
        self.user = list(user)          # (name, object)
        self.disabled: set = set()      # user proposers that raised while serving
        self.rows: dict = {}            # batch row -> _Request
        self.stats = {"steps": 0, "proposed": 0, "accepted": 0, "probes": 0, "rebuilt": 0, "moved": 0}

    def set_corpus(self, datastore) -> None:
        """Corpus tables ready (built in the background): requests that start from now on draft from them."""
        self.corpus = datastore

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self, sampled, num_tokens, token_ids) -> list:
        self.stats["steps"] += 1
        n_rows = len(sampled)
        old, self.rows = self.rows, {}
        orphans = {}
        for i, req in old.items():   # a row past the batch, or holding another request now, lost its request
            if i >= n_rows or not sampled[i] or not req.matches(token_ids[i], int(num_tokens[i])):
                if i < n_rows and not sampled[i] and req.matches(token_ids[i], int(num_tokens[i])):
                    self.rows[i] = req   # a step without a sampled token (a chunk of a prefill): keep as is
                else:
                    orphans[i] = req
            else:
                self.rows[i] = req
        drafts = []
        for i in range(n_rows):
            new = sampled[i]
            if not new:
                drafts.append([])
                continue
            n = int(num_tokens[i])
            row = token_ids[i]
            req = self.rows.get(i)
            if req is None:   # moved here by vLLM's condensing, or a new request
                j = next((j for j, r in orphans.items() if r.matches(row, n)), None)
                if j is not None:
                    req = orphans.pop(j)
                    self.stats["moved"] += 1
                else:
                    req = _Request(row[:n].tolist(), len(new), self)
                    self.stats["rebuilt"] += 1
                self.rows[i] = req
            if req.length() < n:
                start = req.length()
                req.extend(row[start:n].tolist())
                self._learn(req, start)
            drafts.append(self._propose(req, n))
        for req in orphans.values():   # finished (or preempted: it starts again as a new request)
            out = req.output()
            if "history" in self.opts["sources"] and out:
                self.history.add(out)
        return drafts

    def _learn(self, req: _Request, start: int) -> None:
        """Feed back how much of last step's draft the verify pass accepted: the tokens that followed it."""
        if req.last is None:
            return
        chain, at, src = req.last
        req.last = None
        if at != start:   # not the position it was drafted for (vLLM dropped the draft): nothing to learn
            return
        got = req.tokens[at - req.offset:]   # the accepted draft tokens, then the target's own next token
        for j, tok in enumerate(chain.tokens[:len(got)]):
            hit = got[j] == tok
            src.observe(chain.keys[j], hit)
            self.stats["accepted"] += hit
            if not hit:
                break
        req.gap = 1 if got and got[0] == chain.tokens[0] else min(2 * req.gap, self.opts["probe_gap"])

    def _propose(self, req: _Request, n: int) -> list:
        k = min(self.k, self.max_model_len - n - 1)
        if k < 1:
            return []
        floor = float(self.opts["floor"])
        ctx = Context(req.tokens, k, floor)
        best = None   # (expected accepted tokens, tokens worth sending, chain, source)
        for src in req.srcs:
            if src.name in self.disabled:
                continue
            try:
                got = src.propose(ctx)
            except SwiftkError as e:
                if not isinstance(src, UserProposer):
                    raise
                self.disabled.add(src.name)   # a user's bug must not take the server down: off, said once
                log.warning("swiftk: %s; this proposer is switched off", e)
                continue
            for chain in (got if isinstance(got, list) else [got] if got is not None else []):
                cut, v, reach = 0, 0.0, 1.0
                for p in chain.probs[:k]:
                    reach *= p
                    if reach < floor and cut:
                        break
                    cut, v = cut + 1, v + reach
                if cut and (best is None or v > best[0]):
                    best = (v, cut, chain, src)
        if best is None:
            return []
        _, cut, best, best_src = best
        toks = list(best.tokens[:cut])
        if best.probs[0] < floor:   # expected not to pay: only a probe, now and then
            if req.wait > 0:
                req.wait -= 1
                return []
            req.wait = req.gap
            toks = toks[:1]
            self.stats["probes"] += 1
        if any(not 0 <= t < self.vocab_size for t in toks):
            return []
        best = type(best)(toks, list(best.probs[:len(toks)]), best.source, list(best.keys[:len(toks)]))
        req.last = (best, req.length(), best_src)
        self.stats["proposed"] += len(toks)
        return toks


def _tokenizer(path):
    """swiftk's tokenizer of a local Hugging Face directory, or None (a hub name, no tokenizer.json)."""
    from ..tokenizer import Tokenizer

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
        from ..datastore import cached_stdlib_datastore, corpus_fingerprint, engine_corpus

        tok = _tokenizer(path)
        if tok is None:
            log.warning("swiftk: corpus n-grams off: %r is not a local directory with tokenizer.json", path)
            return
        ident = {"fingerprint": tok.fingerprint()}
        ds = cached_stdlib_datastore(corpus_fingerprint(tok, ident))
        if ds is not None and ds.max_token() < vocab:
            self.drafter.set_corpus(ds)
            return

        def build():
            try:   # the lowest CPU priority (Linux: per thread): serving goes first
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (AttributeError, OSError):
                pass
            ds, why = engine_corpus(tok, ident, vocab)
            if why:
                log.warning(why)
            else:
                self.drafter.set_corpus(ds)

        threading.Thread(target=build, daemon=True, name="swiftk-corpus").start()

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's runners call this on every proposer; there is no model to load."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list:
        return self.drafter.step(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)

