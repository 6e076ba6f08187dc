"""A batch drafter over swiftk's free sources, independent of any engine: ``Drafter.step`` takes the rows of a
batch as vLLM's proposer hook passes them (each row's new tokens, lengths, token buffers) and returns a draft per
row; ``StepCosts`` turns the engine's step times into the floor a draft token must clear. swiftk.integrations.vllm
wraps it for vLLM."""
from __future__ import annotations

import logging
import time
from typing import Optional

from ..target.costs import LinearFit
from ..errors import SwiftkError
from ..proposers.base import Context
from ..proposers.context import ContextNgrams
from ..proposers.corpus import CorpusNgrams
from ..proposers.history import SessionHistory
from ..proposers.suffix import OutputHistory
from ..proposers.user import UserProposer

log = logging.getLogger("swiftk.vllm")

MAX_K = 64
_SIG = 16   # tokens at each end of a request that identify it across steps


class _Row:
    """The drafting state of the request in one of vLLM's batch rows: its latest tokens (at most ``context_tokens``),
    their automaton, its walk over the history, its sources. Not a swiftk request (requests.Request): vLLM owns the
    request and decodes it; this follows it from step to step."""

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


PRIOR_FLOOR = 0.1   # before the step times say otherwise: a verified token costs a tenth of what a step yields


class StepCosts(LinearFit):
    """vLLM's step time against the tokens it verified, fitted online: dt = a + b * T (least squares, forgetting
    old steps), from the time between two propose calls of steps in which no request came or left. One more
    draft token costs b; it pays when its chance of being accepted beats b times the tokens a step emits over the
    step's time: that is the floor. It is priced for the batch at hand (its rows times the tokens a row sent and
    emitted per step): a full batch, where one more token costs a share of every request's step, gets a higher
    floor than a batch drained to its last requests. Where the fit has no spread in T (or says b <= 0) the floor
    stays the prior."""

    def __init__(self, decay: float = 0.98, min_steps: int = 16):
        super().__init__(decay, min_steps)
        self.emitted = self.rows = 0.0

    def observe(self, tokens: int, emitted: int, dt: float, rows: int = 1) -> None:
        if not (0 < dt < 60) or tokens < 1 or rows < 1:
            return
        g = self.decay
        self.emitted, self.rows = g * self.emitted + emitted, g * self.rows + rows
        self.add(tokens, dt)

    def floor(self, rows: Optional[int] = None) -> float:
        """The floor for a step of ``rows`` requests (None: the mean batch of the timed steps)."""
        ab = self.fit()
        if ab is None:
            return PRIOR_FLOOR
        a, b = ab
        n = self.rows / self.w if rows is None else rows
        step_s = a + b * n * self.t / self.rows   # at the mean batch: the mean step (the fit goes through it)
        return min(max(b * n * (self.emitted / self.rows) / step_s, 0.01), 0.9)


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
        self.rows: dict = {}            # batch row -> _Row
        # seconds: host time spent in step(), what drafting adds to each of the engine's steps
        self.stats = {"steps": 0, "proposed": 0, "accepted": 0, "probes": 0, "rebuilt": 0, "moved": 0,
                      "seconds": 0.0}
        self.costs = StepCosts()
        self.sent = 0   # tokens the next verify pass reads: a token per row plus the drafts sent
        self.last_t = 0.0

    def floor(self, rows: Optional[int] = None) -> float:
        """The chance of being reached below which a draft token does not pay: the option, or (auto) the measured
        cost of one more verified token times the tokens a step of ``rows`` requests emits, over that step's time.
        Before enough clean steps are timed: PRIOR_FLOOR."""
        f = self.opts["floor"]
        return float(f) if f != "auto" else self.costs.floor(rows)

    def set_corpus(self, datastore) -> None:
        """Corpus tables ready (built in the background): requests that start from now on draft from them."""
        self.corpus = datastore

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self, sampled, num_tokens, token_ids) -> list:
        self.stats["steps"] += 1
        now = time.perf_counter()
        n_rows = len(sampled)
        clean = n_rows == len(self.rows) and all(sampled)   # no request came, left or prefilled: a timed step
        old, self.rows = self.rows, {}
        orphans = {}
        for i, req in old.items():   # a row past the batch, or holding another request now, lost its request
            if i < n_rows and req.matches(token_ids[i], int(num_tokens[i])):
                self.rows[i] = req
            else:
                orphans[i] = req
        drafts = []
        floor = self.floor(sum(1 for x in sampled if x))   # priced for this step's batch
        for i in range(n_rows):
            new = sampled[i]
            if not new:
                drafts.append([])
                continue
            n = int(num_tokens[i])
            row = token_ids[i]
            req = self.rows.get(i)
            if req is None:   # moved here by vLLM's condensing, or a new request
                clean = False
                j = next((j for j, r in orphans.items() if r.matches(row, n)), None)
                if j is not None:
                    req = orphans.pop(j)
                    self.stats["moved"] += 1
                else:
                    req = _Row(row[:n].tolist(), len(new), self)
                    self.stats["rebuilt"] += 1
                self.rows[i] = req
            if req.length() < n:
                start = req.length()
                req.extend(row[start:n].tolist())
                self._learn(req, start)
            drafts.append(self._propose(req, n, floor))
        for req in orphans.values():   # finished (or preempted: it starts again as a new request)
            out = req.output()
            if "history" in self.opts["sources"] and out:
                self.history.add(out)
        if clean and not orphans:
            self.costs.observe(self.sent, sum(len(x) for x in sampled), now - self.last_t, n_rows)
        self.last_t, self.sent = time.perf_counter(), n_rows + sum(len(d) for d in drafts)
        self.stats["seconds"] += self.last_t - now
        return drafts

    def _learn(self, req: _Row, start: int) -> None:
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

    def _propose(self, req: _Row, n: int, floor: float) -> list:
        k = min(self.k, self.max_model_len - n - 1)
        if k < 1:
            return []
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
