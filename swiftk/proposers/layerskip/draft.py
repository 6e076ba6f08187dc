"""The layer-skip draft (SWIFT, Self-SD, early exit): the target model itself run with some sublayers skipped,
one token at a time, proposing a spine with candidate siblings (levels) instead of a free chain.

With ``search`` the skip set is the learned state's incumbent and the on-the-fly search (search.py) scores a
candidate on the last ``context_window`` tokens whenever its time budget allows; otherwise the set is fixed
(early exit, a static set). The draft runs only while the gate expects it to pay. Its calibration (draft
probability -> acceptance chance) lives in the learned state.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..draft_loop import ModelDrafter, draft, matchness
from ...runtime.skipset import SkipSet, to_layers
from .search import PAYS

_EXPLORE = 1  # optimization steps at half the budget before what they found sets the search's budget
# what a finished search must be able to gain before one runs: its first step (then two matchness passes over a
# window; now one) cost 1.6-6.7% of cold calls on CPU blocks, where it found sets at matchness 0.06-0.09 (0.74-0.91
# pays) that drafted nothing, and the lightest set gained 2-35% even at the stopping point (GPUs: a pass of 8 ~ one
# step)
SEARCH_MARGIN = 0.25
# a speed search whose best set, after its first candidates, accepts under this share of what would pay is given up
# (and its set never drafted): on CPU blocks every search started at 0.0-0.09 against 0.74-0.91 (SmolLM2,
# Qwen2.5-0.5B and 1.5B), on an H100 at 0.02-0.06, and none came within reach later; a set that starts within a
# quarter has room for the search to find one that pays
HOPELESS = 0.25


class LayerSkipDraft(ModelDrafter):
    def __init__(self, state, costs, skip=None, search: bool = True, head=None, kvq: bool = False):
        """``skip``: a fixed bool [2L] skip set (no search), or None for the state's incumbent; ``head``: the
        reduced-vocabulary draft head (draft_head.DraftHead, reset to its base tokens) or None for the full LM head."""
        super().__init__(state, head)
        self.costs = costs
        self.fixed = None if skip is None else skip.cpu()
        self.opt = state.optimizer if search and skip is None else None
        self.kvq = kvq
        self._set: Optional[SkipSet] = None
        self._memo: dict = {}   # name -> (cost clock, what it was computed for, value): see _cached

    # ---- what the round asks
    def skip(self, device) -> SkipSet:
        mask = self.fixed if self.fixed is not None else self.state.optimizer.best
        if self._set is None or self._set.mask is not mask and not mask.equal(self._set.mask):
            kept = self.costs.kept_fraction(mask, None if self.head is None else self.head.weight_bytes)
            self._set = SkipSet.of(mask, device, kept)
        return self._set

    @property
    def boundary(self) -> Optional[int]:
        return self._set.boundary if self.kvq and self._set is not None else None

    def step_cost(self) -> float:
        return self.costs.draft(self._set.kept if self._set is not None else 1.0)

    def observe_cost(self, seconds_per_step: float) -> None:
        self.costs.observe_draft(self._set.kept, seconds_per_step)

    def optimize(self, dc) -> tuple:
        """One search step when its budget allows: (the round's phase, what it found or None)."""
        opt, st = self.opt, self.state
        if opt is None or opt.done or dc.gate.auto and not self._can_pay():
            return "accelerate", None
        W, t = st.cfg.context_window, time.perf_counter()
        cost = self.costs.opt or self.costs.v(W)   # of one search step: within budget of the time decoded so far
        if dc.decoded < W + 1 or st.time_optimize_s + cost > self._budget() * (st.time_decode_s + dc.elapsed):
            return "context", None
        # never slower than plain decoding: a step spends what this call's drafts saved plus call_budget of its
        # time, so a lump of search never lands on a call that gained nothing
        if dc.gate.auto and cost > dc.ahead + st.cfg.call_budget * dc.elapsed:
            return "context", None
        m, src, passes = self._search_step(dc, dc.tokens[-W - 1:-1])
        dt = time.perf_counter() - t
        st.time_optimize_s += dt
        self.costs.observe_opt(dt / passes)
        if dc.gate.auto and self._hopeless():   # speculate='always' (the paper's rule) searches on
            opt.finish()
        return "optimize", (st.tokens_seen + dc.decoded, m, src)

    def resting(self, gate, device) -> bool:
        """No search step can run (none, finished, or unable to pay) and the set is not drafted with: a given-up
        search on small models over CPU blocks, every round of every later call. Asking reads the memos optimize and
        propose read (so it follows the costs as they do); the round's view, a search check and a propose cost ~10-15
        us in the loop (~0.5% of a SmolLM2 step)."""
        if self.opt is None or not gate.auto:
            return False
        return (self.opt.done or not self._can_pay()) and not self._may_pay(self.skip(device), gate)

    def propose(self, dc) -> list:
        """Draft levels for the round, or [] when the set is not expected to pay or the gate says wait."""
        sk = self.skip(dc.model.device)
        if not (self._may_pay(sk, dc.gate) and dc.gate.should_draft()):
            return []
        return draft(dc.model, dc.cache, dc.tokens[-1], sk, dc.sampler, dc.gate, self.calibrate, self.step_cost(),
                     max_draft=dc.max_draft, max_spine=dc.max_spine, topk_bins=dc.bins,
                     boundary=self.boundary, head=_logits_of(self._head(dc.tokens)), rejection=dc.rejection)

    def finish(self, stats) -> None:
        stats.skip_set = to_layers(self.fixed if self.fixed is not None else self.state.skip_set)
        if self.fixed is None:
            o = self.state.optimizer
            stats.best_matchness, stats.optimization_done, stats.optimization_steps = o.best_matchness, o.done, o.steps
            stats.longest_bo_stall_ms = o.longest_stall_s * 1e3
            stats.bo_errors = list(o.bo_errors)

    # ---- inside
    def _search_step(self, dc, window: list) -> tuple:
        """Score one candidate skip set on the window (and the incumbent, when a challenger is being re-scored).
        Returns (matchness, source, passes run)."""
        opt, dev, pending, head = self.opt, dc.model.device, dc.tokens[-1], self._head(dc.tokens)
        hb = None if self.head is None else self.head.weight_bytes

        def score(m, mask):
            return self.costs.expected_rate(m, self.costs.kept_fraction(mask, hb)) \
                if self.state.cfg.objective == "speed" else m

        def match(mask):
            return matchness(dc.model, dc.cache, window, pending, mask.to(dev), head)

        if opt.best_score < 0:   # the first step scores the starting set alone: where it is hopeless (every CPU
            # search so far: 0.0-0.09 of the 0.74-0.91 that pays) the search ends after one pass instead of two
            m0 = match(opt.best)
            opt.report(opt.best, m0, score(m0, opt.best), "initial")
            return m0, "initial", 1
        passes = 1
        cand, src = opt.propose()
        m = match(cand)
        inc = None
        if src == "rescore":
            inc = score(match(opt.best), opt.best)
            passes += 1
        opt.report(cand, m, score(m, cand), src, incumbent_score=inc)
        return m, src, passes

    def _budget(self) -> float:
        """Optimization's share of wall time. The search is an investment: its first candidates get half the
        budget, a set expected to beat plain decoding (by PAYS) earns the full budget, and otherwise the budget
        follows how close the best set came: half of it times the square of its acceptance over the acceptance that
        would pay (0.25 against 0.6 on float32 CPU weights: a twelfth; 0 on small models over CPU blocks: the floor,
        a fiftieth, which still notices text that a skip set drafts well)."""
        o, b = self.state.optimizer, self.state.cfg.opt_budget
        if self.state.cfg.objective != "speed" or o.best_score >= PAYS:
            return b
        if o.steps < _EXPLORE:
            return b / 2
        return max(b / 50, b / 2 * min(1.0, self._closeness()) ** 2)

    def _closeness(self) -> float:
        """The best set's acceptance over the acceptance at which it would pay (speed objective)."""
        o = self.state.optimizer
        need = self._cached("need", o.best, lambda: self.costs.break_even(self.costs.kept_fraction(
            o.best, None if self.head is None else self.head.weight_bytes)))
        return (o.best_matchness or 0.0) / need

    def _hopeless(self) -> bool:
        """After the first candidates (_EXPLORE steps) of a speed search: the best set so far accepts under
        HOPELESS of what would pay, so the search is given up (the learned state keeps that: later calls pay
        nothing for it). ``give_up`` >= ``max_opt_steps`` turns this off with the other give-up rule."""
        o, c = self.state.optimizer, self.state.cfg
        return (c.objective == "speed" and c.give_up < c.max_opt_steps and o.steps >= _EXPLORE
                and o.best_score < PAYS and self._closeness() < HOPELESS)

    def _can_pay(self) -> bool:
        """Whether the lightest set the search may pick would beat plain decoding by SEARCH_MARGIN at the acceptance
        where the search would stop as done (``max_matchness``, 0.95), at the measured step, draft and verify
        costs. Where it would not (small models on CPU blocks,
        whose verify passes cost several steps) a search step is time lost; the check follows the costs as they
        are measured, so a cheaper verify (a GPU, a larger model) lets the search run again."""
        return self._cached("can_pay", None, self._lightest_can_pay)

    def _lightest_can_pay(self) -> bool:
        o, c = self.state.optimizer, self.costs
        L, n = o.n // 2, o.skip_count
        heavy, light = (1, 0) if c.mlp_bytes >= c.attn_bytes else (0, 1)   # sublayer kinds, heavier first
        k = min(n, L - 2)
        mask = torch.zeros(o.n, dtype=torch.bool)
        mask[[2 * i + heavy for i in range(1, 1 + k)]] = True
        mask[[2 * i + light for i in range(1, 1 + min(n - k, L - 2))]] = True
        kf = c.kept_fraction(mask, None if self.head is None else self.head.weight_bytes)
        return c.expected_rate(self.state.cfg.max_matchness, kf) >= 1.0 + SEARCH_MARGIN

    def _may_pay(self, sk: SkipSet, gate) -> bool:
        """The search's measurement of the incumbent (matchness on recent windows) predicts what drafting with it
        would give: below plain speed the loop does not draft with it -- while the search runs (the matchness passes
        are the cheaper probes) and after a speed search ended (given up, its set could only lose). Fixed sets, a
        finished matchness search and speculate="always" draft as the gate says."""
        if self.opt is None or not gate.auto or self.opt.done and self.state.cfg.objective != "speed":
            return True
        # no measurement yet (a cold start's first window): plain steps and free drafts until one
        m = self.opt.best_matchness
        return m is not None and self._cached("may_pay", (m, sk.kept),
                                              lambda: self.costs.expected_rate(m, sk.kept) >= 1.0)

    def _cached(self, name: str, key, compute):
        """``compute()``, reused while the cost model has seen fewer than 32 new observations and ``key`` (what it
        was computed for) is the same: the loop asks every round, the costs move slowly."""
        clock, hit = self.costs.clock, self._memo.get(name)
        if hit is None or clock - hit[0] >= 32 or not _same(hit[1], key):
            hit = self._memo[name] = (clock, key, compute())
        return hit[2]


def _same(a, b) -> bool:
    return a is b or (type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b)


def _logits_of(head):
    return None if head is None else head.logits_full
