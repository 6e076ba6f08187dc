"""The gate: per-round decisions of one call from the target's measured costs (target/costs.py) and the
sources' acceptance estimates -- draft or take a plain step, how deep, how many tree nodes.

Speed model (docs/design.md): with one decode step costing ``step`` seconds, a round that drafts k tokens at ``draft``
each and verifies T nodes at ``v(T)`` emits M tokens; it pays when M / (k*draft + v(T)) > 1 / step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..target.costs import CostModel, ema
from .tree import node_values

_MARGIN = 0.03  # the least predicted gain a verify pass must promise (Gate.tree_size)
# ... beside other calls' rows: there a row's share of a pass is larger, and where passes are compute-bound (AVX2
# int8) a draft row only breaks even when accepted, while the free estimates ran ~10% above what was accepted
# (decoding/batch.py; bench/results/history.md, "Batching")
_BATCH_MARGIN = 0.15


@dataclass(frozen=True)
class Beside:
    """What else rides in a round's pass (decoding/batch.py): other calls' rows, the tokens they are expected to
    yield, and the seconds of a pass of T rows there (None: the cost model's ``v``)."""

    rows: int = 0
    tokens: float = 0.0
    price: Optional[Callable[[int], float]] = None


ALONE = Beside()


class Gate:
    """Per-round decisions from the cost model and the acceptance estimates, for one call.

    ``speculate="always"`` is the paper's rule (draft every round, stop below ``eps``, fixed tree budget).
    ``"auto"`` drafts while the expected tokens per second of the round grows, keeps the tree nodes that pay for
    their verify cost, and takes plain steps when recent drafting rounds were slower than plain decoding --
    probing again after a gap that doubles on every failed probe (so a text that becomes predictable is noticed
    and an unpredictable one costs a few percent at most). The model drafter's record (``memory``, a
    state.GateMemory) carries across calls; the free sources' probing belongs to one text and lives here."""

    def __init__(self, costs: CostModel, memory, cfg):
        self.costs, self.memory, self.cfg = costs, memory, cfg
        self.auto = cfg.speculate == "auto"
        self.free_since = 0     # free proposals declined since the last one verified
        self.free_gap = 4       # ... after which one is verified anyway (a probe), doubling while probes miss
        self.probing = False    # the tree being verified is such a probe
        self._free_est = None   # the free tree's estimated rate this round (model_draft_pays), for free_measured
        self.model_since, self.model_gap = 0, 4      # model drafts declined beside free chains, and the probe gap

    def should_draft(self) -> bool:
        m = self.memory
        if not self.auto or m.draft_rate is None or m.draft_rate > 1.0:
            return True
        m.since_draft += 1
        return m.since_draft >= m.probe_gap

    def drafted(self, rate: float) -> None:
        """After a round that drafted: its measured rate in plain-step units (1.0 = as fast as plain)."""
        m = self.memory
        was_probe = m.draft_rate is not None and m.draft_rate <= 1.0
        m.draft_rate = ema(m.draft_rate, rate) if m.draft_rate is not None else rate
        m.since_draft = 0
        if was_probe:
            m.probe_gap = 4 if m.draft_rate > 1.0 else min(128, m.probe_gap * 2)

    def model_draft_pays(self, chains: list) -> bool:
        """Whether a draft model's steps (~0.3 of a plain step each) are worth taking beside the free ``chains``:
        its recent rounds' measured rate beats the free tree's expected one, scaled by what free-only rounds
        measured against it (``free_measured``; the estimates ran 1.5-2x low). Drafting every round made code chat
        0.70x of the free chains alone (Qwen2.5-Coder-1.5B with its 0.5B sibling)."""
        rate, self._free_est = self.memory.draft_rate, None
        if not self.auto or rate is None or not chains:
            return True
        c, best, tokens = self.costs, 0.0, 1.0
        for n, v in enumerate(node_values(chains), 1):
            tokens += v
            best = max(best, tokens * c.v(1) / c.v(n + 1))
        self._free_est = best
        if rate > best * self.memory.free_bias:
            return True
        # a probe now and then, the gap doubling (at every 4th round, code chat paid 2x for model rounds)
        self.model_since += 1
        if self.model_since < self.model_gap:
            return False
        self.model_since, self.model_gap = 0, min(64, 2 * self.model_gap)
        return True

    def free_measured(self, accepted: int, size: int) -> None:
        """After a round verified with free chains only (``accepted`` tokens from a tree of ``size``): its rate in
        plain-step units, against the estimate ``model_draft_pays`` made for it (none without a draft model)."""
        if self._free_est:
            m, rate = self.memory, accepted * self.costs.v(1) / self.costs.v(size)
            m.free_bias += 0.2 * (min(4.0, max(0.25, rate / self._free_est)) - m.free_bias)
            self._free_est = None

    def free_size(self, sunk_s: float, values: list, beside: Beside = ALONE) -> int:
        """``tree_size`` for a round with only free nodes, plus probing: the free sources' estimates learn only
        from verified proposals, so once they fall below break-even (chat) they would never see the text start
        repeating (code after chat). Every ``free_gap``-th declined proposal is verified anyway (its first node,
        the cheapest pass); the gap doubles while probes miss and resets when one is accepted."""
        n = self.tree_size(sunk_s, values, beside)
        if n or not self.auto or not values:
            self.free_since = 0
            return n
        if not self.tree_size(sunk_s, [1.0] * len(values), beside):
            return 0   # not even a certain proposal would pay for its verify pass: a probe can only lose
        self.free_since += 1
        if self.free_since < self.free_gap:
            return 0
        self.free_since, self.probing = 0, True
        return 1

    def probed(self, hit: bool) -> None:
        """The outcome of a verified probe (only called while ``probing``)."""
        self.probing = False
        self.free_gap = 4 if hit else min(128, self.free_gap * 2)

    def keep_drafting(self, depth: int, conf: float, a: float, surv: float, tokens: float, step_s: float) -> bool:
        """After ``depth`` draft steps of ``step_s`` seconds each (top-1 probability ``conf``, calibrated ``a``;
        chain survival ``surv``, expected tokens ``tokens``): one more?"""
        if not self.auto:
            return conf >= self.cfg.eps
        c = self.costs
        sunk = depth * step_s
        now = tokens / (sunk + c.v(depth + 1))
        more = (tokens + surv * a) / (sunk + step_s + c.v(depth + 2))
        return more > now

    @property
    def value_floor(self) -> float:
        """Nodes less likely than this to be accepted are never worth verifying: a node pays only if its chance
        exceeds its extra verify cost in steps, and that cost is at least half the prior's slope on every device
        measured (CPU 0.03-0.06 per token, H100 ~0.004). Chains are cut there before they are built."""
        return 0.5 * self.costs.slope if self.auto else 0.0

    def tree_size(self, sunk_s: float, values: list, beside: Beside = ALONE) -> int:
        """Non-root nodes to verify, given their acceptance values sorted best first and the time already spent.
        ``beside`` other calls' rows, a node pays where it raises the whole pass's tokens per second."""
        if not self.auto:
            return len(values)
        rows, others = beside.rows, beside.tokens
        v = beside.price or self.costs.v
        plain = (others + 1.0) / (sunk_s + v(rows + 1))
        best_n, best, tokens = 0, plain, others + 1.0
        floor = self.value_floor
        for n, val in enumerate(values, 1):
            if val < floor:   # sorted: no later node pays either
                break
            tokens += val
            r = tokens / (sunk_s + v(rows + n + 1))
            if r > best:
                best_n, best = n, r
        # a predicted gain within the cost model's error (noisy timings, host work per round it does not price)
        # is not worth a verify pass: the loop must never be slower than plain decoding
        return best_n if best >= plain * (1.0 + (_BATCH_MARGIN if rows else _MARGIN)) else 0
