"""One call's decoding state, in one owner: the sequence so far, the sampler, the output sink, the gate's per-call
decisions, the telemetry. The decode round (loop.py) reads it top to bottom; the KV cache moves its own cursor.

Slot layout during a round with ``n`` committed tokens: slots [0, n) hold committed target KV; the pending token
(the tree's root, emitted but not yet in the cache) and the tree go to slots n, n+1, ...; draft steps and the
search's matchness passes write scratch KV there too. ``cache.commit`` moves the accepted path's KV to n, n+1, ...
"""
from __future__ import annotations

import time

from .costs import CostModel, Gate
from ..proposers.base import DraftContext
from .output import DecodeStats, Timer, TokenSink
from .passes import prefill, step_logits
from .sampler import Sampler
from .tree import DRAFT, ROOT


class Session:
    def __init__(self, model, cache, costs: CostModel, gate: Gate, sampler: Sampler, sink: TokenSink, cfg,
                 prompt_ids: list, source_names=(), reuse: int = 0):
        self.model, self.cache, self.costs, self.gate = model, cache, costs, gate
        self.reuse = reuse   # prompt slots whose KV an earlier call left in the cache (passes.prefill)
        self.sampler, self.sink, self.cfg = sampler, sink, cfg
        self.tokens = list(prompt_ids)   # prompt + emitted tokens; once prefilled the last is the pending root
        self.prompt_len = len(prompt_ids)
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

    def start(self) -> None:
        """Prefill the prompt; the first new token becomes the pending root."""
        t = time.perf_counter()
        self.tokens.append(prefill(self.model, self.cache, self.tokens, self.sampler, self.reuse))
        self.stats.decoding_steps = 1
        self.timer.add("prefill", t)
        self.done = self.sink.push(self.tokens[-1])

    def plain_step(self, phase: str):
        """The cheapest way to the next token when no draft pays. Returns the target's scores [1, V] after the
        token it read (the old root)."""
        t0 = time.perf_counter()
        tok, logits = step_logits(self.model, self.cache, self.tokens[-1], self.sampler)
        self.tokens.append(tok)
        st = self.stats
        st.decoding_steps += 1
        st.plain_steps += 1
        if self.cfg.trace:
            st.phases.append("plain" if phase == "accelerate" else phase)
        self.done = self.sink.push(self.tokens[-1])
        self._gain = self.timer.add("verify", t0) - t0
        self.costs.observe_step(self._gain)
        return logits

    def commit(self, tree, nodes: list, bonus: int, phase: str, t_draft: float, t_verify: float,
               n_levels: int) -> None:
        """The accepted path's (``nodes``: indices root..last) KV into the committed prefix, its tokens and the
        bonus into the sequence."""
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
        self.done = self.sink.extend(new)

    def finish(self) -> DecodeStats:
        st, tot = self.stats, self.timer.totals
        st.time_prefill_s = tot.get("prefill", 0.0)
        st.time_optimize_s, st.time_draft_s = tot.get("optimize", 0.0), tot.get("draft", 0.0)
        st.time_verify_s, st.time_other_s = tot.get("verify", 0.0), tot.get("other", 0.0)
        st.costs = self.costs.to_dict()
        return st.finish()
