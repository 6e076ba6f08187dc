"""One call's decoding state, in one owner: the sequence so far, the sampler, the output sink, the gate's per-call
decisions, the telemetry. The decode round (loop.py) reads it top to bottom; the KV cache moves its own cursor.

Slot layout during a round with ``n`` committed tokens: slots [0, n) hold committed target KV; the pending token
(the tree's root, emitted but not yet in the cache) and the tree go to slots n, n+1, ...; draft steps and the
search's matchness passes write scratch KV there too. ``cache.commit`` moves the accepted path's KV to n, n+1, ...
"""
from __future__ import annotations

import time
from typing import Optional

from ..errors import SwiftkError
from ..target.costs import CostModel
from .gate import Gate
from ..proposers.base import DraftContext
from .grammar import GrammarState
from .output import DecodeStats, Timer, TokenLogprobs, TokenSink
from .passes import prefill_rows, step_rows
from ..sample.sampler import Sampler
from .tree import DRAFT, ROOT


class Session:
    def __init__(self, model, cache, costs: CostModel, gate: Gate, sampler: Sampler, sink: TokenSink, cfg,
                 prompt_ids: list, source_names=(), reuse: int = 0, logprobs: Optional[TokenLogprobs] = None,
                 grammar: Optional[GrammarState] = None):
        self.model, self.cache, self.costs, self.gate = model, cache, costs, gate
        self.reuse = reuse   # prompt slots whose KV an earlier call left in the cache (passes.prefill)
        self.sampler, self.sink, self.cfg = sampler, sink, cfg
        self.tokens = list(prompt_ids)   # prompt + emitted tokens; once prefilled the last is the pending root
        self.prompt_len = len(prompt_ids)
        self.filled = None   # prompt tokens whose KV is in the cache (None: the prefill has not started)
        self.rejection = not sampler.greedy and cfg.sampling == "rejection"
        self.bins = cfg.topk_greedy if sampler.greedy else cfg.topk_sampling
        self.max_nodes = cfg.max_tree_nodes or (64 if gate.auto else costs.budget())
        self.stats, self.timer = DecodeStats(), Timer()
        self.stats.accepted_by_source = {name: 0 for name in (DRAFT, *source_names)}
        self.stats.max_tree_nodes = self.max_nodes
        self.t_start = time.perf_counter()
        self.ahead = 0.0   # seconds this call is ahead of plain decoding (begin_round keeps the account)
        self._round, self._gain = None, 0.0   # the open round's start, and what it produced in plain-step seconds
        self.done = False
        self.logprobs = logprobs   # the emitted tokens' log-probabilities, when the call asked for them
        self.grammar = grammar     # the call's constraint (decoding/grammar.py): it masks every choice

    @property
    def measured(self) -> bool:
        """The cost model has timed a plain step (an engine's first round is one): drafts can be priced."""
        return self.costs.step is not None

    def draft_context(self) -> DraftContext:
        """The round's view for a model drafter."""
        now, decoded = time.perf_counter(), len(self.tokens) - self.prompt_len
        return DraftContext(self.model, self.cache, self.tokens, self.sampler, self.gate, self.cfg.max_draft,
                            self.max_nodes - 1, self.bins, self.rejection, decoded, now - self.t_start, self.ahead)

    def begin_round(self) -> float:
        """Close the last round's account and open this one's; returns now. The call's lead over plain decoding
        gains what the last round produced (its tokens at a plain step each, or the plain step it took, as timed)
        less everything it took: search, drafting, tree, acceptance, bookkeeping. Counting only drafted rounds'
        own time left out the host work of every round (~0.3 ms on a 2.7-9 ms step): a call at 0.93x plain
        decoding looked ahead, and its search step made it slower."""
        now = time.perf_counter()
        if self._round is not None:
            self.ahead += self._gain - (now - self._round)
        self._round, self._gain = now, 0.0
        return now

    def searched(self, t0: float, found) -> None:
        """A skip-set search step ran since ``t0`` (charged to the round); ``found``: (tokens seen, matchness,
        where the candidate came from), kept in the trace."""
        self.timer.add("optimize", t0)
        if self.cfg.trace:
            self.stats.matchness_history.append(found)

    @property
    def prefilling(self) -> bool:
        return self.filled is None or self.filled < self.prompt_len

    def prefill_rows(self, limit: int = 0):
        """The rows of the prompt's next chunk (``limit`` rows at most; 0: all the rest); the first chunk starts
        after the ``reuse`` slots an earlier call left."""
        if self.filled is None:
            if not 0 <= self.reuse < self.prompt_len:
                raise SwiftkError(f"can reuse 0 to {self.prompt_len - 1} of a {self.prompt_len}-token prompt's "
                                  f"slots, not {self.reuse}")
            if self.reuse:
                self.cache.truncate(self.reuse)
            else:
                self.cache.reset()
            self.filled = self.reuse
        end = self.prompt_len if limit <= 0 else min(self.prompt_len, self.filled + limit)
        return prefill_rows(self.model, self.cache, self.tokens, self.filled, end)

    def prefilled(self, rows, logits) -> None:
        """A prefill chunk's pass ran: its KV joins the prefix; after the last chunk the first new token (from
        ``logits`` [1, V], its last row's) becomes the pending root."""
        n = rows.tokens.shape[0]
        self.cache.advance(n)
        self.filled += n
        if self.filled == self.prompt_len:
            self.tokens.append(self.choose(logits[:1], self.prompt_len))
            self.stats.decoding_steps = 1
            self.done = self._emit([self.tokens[-1]], logits[:1])

    def step_rows(self):
        """The row of a plain step: the pending root at the next slot."""
        return step_rows(self.model, self.cache, self.tokens[-1])

    def stepped(self, logits, phase: str, seconds: float, timed: bool = True) -> None:
        """A plain step's pass ran (its scores ``logits`` [1, V] after the old root): the root joins the prefix, the
        next token is picked. ``timed``: ``seconds`` is the step's own (a solo pass), which the cost model learns;
        in a batch the scheduler times its passes."""
        n = self.cache.length
        self.cache.advance(1)
        self.sampler.release(n + 1)
        self.tokens.append(self.choose(logits[:1], n + 1))
        st = self.stats
        st.decoding_steps += 1
        st.plain_steps += 1
        if self.cfg.trace:
            st.phases.append("plain" if phase == "accelerate" else phase)
        self.done = self._emit([self.tokens[-1]], logits[:1])
        if timed:
            self._gain = seconds
            self.costs.observe_step(seconds)
        else:
            self._gain = self.costs.step or seconds

    def commit(self, tree, nodes: list, bonus: int, phase: str, t_draft: float, t_verify: float,
               n_levels: int, logits=None) -> None:
        """The accepted path's (``nodes``: indices root..last) KV into the committed prefix, its tokens and the
        bonus into the sequence (``logits``: the verify pass's, whose row of node i scored the token after it)."""
        self.cache.commit(nodes)
        self.sampler.release(self.cache.length)
        new = [tree.host_tokens[i] for i in nodes[1:]] + [bonus]   # nodes[0] is the old root, already in the sequence
        self.tokens += new
        st, L = self.stats, len(new)
        for i in nodes[1:]:
            st.accepted_by_source[tree.source[i]] = st.accepted_by_source.get(tree.source[i], 0) + 1
        st.drafted_tokens += n_levels + sum(1 for x in tree.source if x not in (ROOT, DRAFT))   # spine + free
        st.accepted_tokens += L - 1
        st.rounds += 1
        # what the round produced: its tokens at a plain step each (a plain round's gain is its own timed step, so
        # a misjudged step errs only on drafted rounds: counted over every token, a step estimate a few % high
        # made a call that drafted nothing look ahead, free to pay for search steps)
        self._gain = L * (self.costs.step or 0.0)
        if self.cfg.trace:   # per-round lists: debugging and plots (they grow with the output)
            expect = (1.0 + sum(tree.value[1:])) / (t_draft + self.costs.v(tree.size))
            st.expected_vs_measured.append((round(expect, 3), round(L / max(t_draft + t_verify, 1e-9), 3)))
            st.accept_lengths.append(L)
            st.tree_sizes.append(tree.size)
            st.phases.append(phase)
        st.decoding_steps += 1
        # the rows only when logprobs are kept: indexing vocabulary-long rows is a torch op that may open an OpenMP
        # team, one per calling thread (tests/test_threads.py)
        self.done = self._emit(new, None if logits is None or self.logprobs is None else logits[nodes])

    def choose(self, row, position: int) -> int:
        """The token the target's scores ``row`` [1, V] choose for ``position``: the sampler's pick, among what the
        grammar allows when the call has one (which then advances by it)."""
        if self.grammar is None:
            return self.sampler.pick(row[0], position)
        t = self.sampler.pick(self.grammar.mask(row)[0], position)
        self.grammar.consume([t])
        return t

    def _emit(self, tokens: list, rows) -> bool:
        """The new tokens into the sink (True: the call ends), each with its log-probabilities first when asked
        (``rows[j]``: the target's scores that chose ``tokens[j]``), so a streamed piece finds its tokens'."""
        lp = self.logprobs
        if lp is None:
            return self.sink.extend(tokens)
        entries = lp.of(rows, tokens)
        for t, e in zip(tokens, entries):
            lp.entries.append(e)
            if self.sink.push(int(t)):
                return True
        return False

    def finish(self) -> DecodeStats:
        st, tot = self.stats, self.timer.totals
        st.time_prefill_s = tot.get("prefill", 0.0)
        st.time_optimize_s, st.time_draft_s = tot.get("optimize", 0.0), tot.get("draft", 0.0)
        st.time_verify_s, st.time_other_s = tot.get("verify", 0.0), tot.get("other", 0.0)
        st.costs = self.costs.to_dict()
        return st.finish()
