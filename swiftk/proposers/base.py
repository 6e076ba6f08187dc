"""What every draft source shares: the chain it proposes, the acceptance estimates it learns, the protocols the
round calls them through (:class:`Proposer` for free sources, :class:`Drafter` for model drafters).

A *free* source (no model pass: context n-grams, the session's earlier outputs, a corpus, a user object) implements

    propose(ctx: Context) -> Chain | list[Chain] | None   # continuations of ctx.tokens (its last token is the
                                                          # tree's root); a list shares prefixes: a tree
    observe(key, hit)                         # node ``key`` of an earlier chain was (not) accepted, its parent was

and owns an :class:`Estimates` table: per key (match length, depth, ...) the chance that a proposed token is
accepted given its parent was. The tree builder prices every node with it, the gate keeps the nodes that pay for
their share of the verify pass, and the loop feeds the outcome back. A source whose estimates should outlive one
call (``carries = True``) keeps them in the learned state, which persists them; the others start fresh per call.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence, Union

from ..errors import SwiftkError

if TYPE_CHECKING:   # annotations only: the protocol and its tables need no torch at import
    import torch

    from ..runtime.kvcache import KVCache
    from ..runtime.model import Model


def k_for_confidence(p: float, bins) -> int:
    """Candidates per depth from the draft's top-1 probability p: (threshold, k) tried in order, else last k."""
    for thr, k in bins:
        if p > thr:
            return k
    return bins[-1][1]


@dataclass
class DraftLevel:
    """Children of spine node ``depth`` (0 = root): candidate tokens in draw/rank order and their draft probs."""

    tokens: list
    probs: list
    dist: Optional[torch.Tensor] = None    # the draft distribution they were drawn from (rejection sampling only)
    hidden: Optional[torch.Tensor] = None  # KVQ: spine node ``depth``'s residual [1, D] at the boundary layer


@dataclass
class Chain:
    """A free draft (no model call): ``tokens`` continuing the root, ``probs[d]`` the estimated chance that token
    d is accepted given its parent was, the ``source`` that proposed it (its name), and ``keys[d]``: what the
    source filed that estimate under (handed back to the source with the outcome)."""

    tokens: list
    probs: list
    source: str
    keys: list = field(default_factory=list)


@dataclass
class Context:
    """What a free source sees each round: the sequence so far (prompt + emitted tokens, the last one being the
    tree's root, not yet in the KV cache), how many tokens a chain may hold, and the estimate below which a
    token is not worth building (the gate's floor)."""

    tokens: list
    k: int
    floor: float


@dataclass
class DraftContext:
    """What a model drafter (layer skip, MoA) sees each round, instead of the call's whole Session: the target and
    its KV cache (draft steps write scratch KV past the committed prefix; ``cache.length`` is that prefix), the
    sequence so far (read only; the last token is the pending root), the sampler and the gate, the round's limits,
    and for the skip-set search how far the call has come."""

    model: "Model"
    cache: "KVCache"
    tokens: list
    sampler: "DraftSampler"
    gate: "DraftGate"
    max_draft: int      # draft steps at most
    max_spine: int      # nodes the tree may still take after its root
    bins: tuple         # candidates per depth by the draft's top-1 probability
    rejection: bool     # tree rejection sampling: keep the draft's distributions
    decoded: int        # tokens emitted so far in this call
    elapsed: float      # seconds since the call started
    ahead: float = 0.0  # seconds this call is ahead of plain decoding: per closed round, its tokens at a plain
    #                     step each (a plain round: its timed step) less all its time, search and host work
    #                     included; what a search step may spend without making the call slower than plain decoding
    chains: list = field(default_factory=list)   # the round's free chains, proposed before the model draft


class DraftSampler(Protocol):
    """What a draft reads of the call's sampler (sample.sampler.Sampler): greedy or not, its settings, and the
    coupled rule's score, so a draft ranks tokens as the target will choose them."""

    sp: object            # SamplingParams: .probs(logits) is the processed distribution both sides use
    generator: "torch.Generator"
    greedy: bool

    def coupled(self, logp: "torch.Tensor", position: int) -> "torch.Tensor": ...


class DraftGate(Protocol):
    """What a drafter asks the call's gate (decoding.gate.Gate): whether to draft this round, one more step."""

    auto: bool

    def should_draft(self) -> bool: ...

    def keep_drafting(self, depth: int, conf: float, a: float, surv: float, tokens: float, step_s: float) -> bool: ...

    def model_draft_pays(self, chains: list) -> bool: ...


class Proposer(Protocol):
    """A draft source that costs no model pass (:class:`FreeSource`, a user's object behind UserProposer). The
    round asks it for chains, tells it which of its nodes were accepted (``observe``), and, where ``learns``, gives
    it the target's scores after each committed token."""

    name: str
    learns: bool

    def propose(self, ctx: Context) -> Union[Chain, list, None]: ...

    def observe(self, key: int, hit: bool) -> None: ...

    def learn(self, tokens: list, logits, rows: list) -> None: ...


class Drafter(Protocol):
    """A model drafter (layer skip, a draft model, MoA; proposers.draft_loop.ModelDrafter holds what they share).
    Each round: ``resting`` (skip it), ``optimize`` (a search step), ``propose`` (DraftLevels, one per depth), and
    after the pass ``observe`` per drafted node and ``observe_cost`` per draft step; ``calibrate`` maps its
    probabilities to acceptance chances; ``finish`` adds its statistics to the call's. ``boundary``: a KVQ exit
    layer (the verify pass starts its spine there), else None. Where ``reads_final``, each pass's row that chose the
    next root token hands its final residual [1, D] to ``take_final`` (None after a pass that kept none)."""

    name: str
    boundary: Optional[int]
    reads_final: bool   # it drafts from the target's final hidden state of the row that chose the root token

    def resting(self, gate: DraftGate, device) -> bool: ...

    def take_final(self, h) -> None: ...

    def optimize(self, dc: DraftContext) -> tuple: ...

    def propose(self, dc: DraftContext) -> list: ...

    def calibrate(self, p: float) -> float: ...

    def observe(self, p: float, hit: bool) -> None: ...

    def step_cost(self) -> float: ...

    def observe_cost(self, seconds_per_step: float) -> None: ...

    def finish(self, stats) -> None: ...


class Estimates:
    """Acceptance chance per key, as (hits, tries) with exponential forgetting, starting from ``prior`` counted as
    ``weight`` observations. Free sources forget fast (``decay`` 0.9: whether text repeats changes within a
    prompt); the layer-skip calibration slowly (0.99)."""

    def __init__(self, prior: Sequence[float], weight: float = 2.0, decay: float = 0.9):
        self.hits = [weight * p for p in prior]
        self.tries = [float(weight)] * len(prior)
        self.decay = decay
        self._probs: Optional[list] = None

    def __len__(self) -> int:
        return len(self.hits)

    def prob(self, key: int) -> float:
        i = min(max(int(key), 0), len(self.hits) - 1)
        return self.hits[i] / self.tries[i]

    def probs(self) -> list:
        """prob(key) for every key, in key order (kept until the next observation: sources read it every round)."""
        if self._probs is None:
            self._probs = [h / t for h, t in zip(self.hits, self.tries)]
        return self._probs

    def observe(self, key: int, hit: bool) -> None:
        self._probs = None
        i = min(max(int(key), 0), len(self.hits) - 1)
        self.hits[i] = self.decay * self.hits[i] + bool(hit)
        self.tries[i] = self.decay * self.tries[i] + 1

    def to_dict(self) -> dict:
        return {"hits": list(self.hits), "tries": list(self.tries)}

    def load_dict(self, d: dict) -> None:
        """Take saved counts of the same shape; a SwiftkError names what does not fit."""
        hits, tries = [float(x) for x in d["hits"]], [float(x) for x in d["tries"]]
        if len(hits) != len(self.hits) or len(tries) != len(self.tries):
            raise SwiftkError(f"estimates have {len(hits)} keys, expected {len(self.hits)}")
        if not all(math.isfinite(h) and math.isfinite(t) and 0 <= h <= t < 1e6 and t > 0
                   for h, t in zip(hits, tries)):
            raise SwiftkError("estimates hold counts out of range")
        self.hits, self.tries, self._probs = hits, tries, None


class FreeSource:
    """Base of the sources that cost no model pass. Subclasses set ``name``, ``prior`` (the estimate per key
    before any observation) and ``carries``, and implement ``propose``."""

    name = "free"
    prior: Sequence[float] = (0.3,)
    carries = False
    learns = False   # True: ``learn(tokens, logits)`` gets the target's scores after every committed token

    def __init__(self, estimates: Optional[Estimates] = None):
        self.est = estimates if estimates is not None else self.new_estimates()

    @classmethod
    def new_estimates(cls) -> Estimates:
        return Estimates(cls.prior)

    def propose(self, ctx: Context) -> Optional[Chain]:
        raise NotImplementedError

    def observe(self, key: int, hit: bool) -> None:
        self.est.observe(key, hit)

    def learn(self, tokens: list, logits, rows: list) -> None:
        """``tokens[i]`` was read by the target, which scored row ``rows[i]`` of ``logits`` [N, V] for the position
        after it (rows, not a copy of them: a verify pass's are 0.2-0.6 MB each)."""

    def chain(self, tokens: list, key: int, ctx: Context) -> Optional[Chain]:
        """``tokens`` all filed under one key, cut where they stop paying (see :func:`useful`)."""
        p = self.est.prob(key)
        n = useful(p, min(ctx.k, len(tokens)), ctx.floor)
        return Chain(tokens[:n], [p] * n, self.name, [key] * n) if n else None


def useful(p: float, k: int, floor: float) -> int:
    """Tokens of a chain whose every token is accepted with chance p (given its parent) worth building: the d with
    p^d >= floor (at most k), and always the first -- the gate's probes verify a declined chain's first token now
    and then, which is how an estimate that fell below the floor learns that the text changed."""
    if floor <= 0.0 or p >= 1.0:
        return k
    if p <= 0.0:
        return min(k, 1)
    return max(min(k, 1), min(k, int(math.log(floor) / math.log(p) + 1e-9)))


def best_first(root, expand: Callable, max_nodes: int, max_depth: int, floor: float, source: str) -> list:
    """The ``max_nodes`` likeliest nodes of a draft tree, grown from ``root`` best first, as root-to-leaf Chains.

    ``expand(handle, depth)`` lists a node's children as (token, handle, p, key), p the chance the child is accepted
    given its parent was; a node's value is the product of p along its path, and nodes below ``floor`` (the gate's
    floor) or deeper than ``max_depth`` are never built -- except the root's first child: the gate's probes verify
    a declined proposal now and then, which is how an estimate that fell below the floor learns that the text
    changed (see :func:`useful`). The kept set is closed under ancestors by construction."""
    nodes: list = []   # (token, parent node or -1, p, key), parents first
    heap: list = []    # candidates: (-value, tiebreak, token, parent node, handle, depth, p, key)

    def offer(handle, parent: int, value: float, depth: int) -> None:
        for rank, (tok, child, p, key) in enumerate(expand(handle, depth)):
            if value * p >= floor or (parent < 0 and rank == 0):
                heapq.heappush(heap, (-value * p, len(heap) + len(nodes), tok, parent, child, depth + 1, p, key))

    if max_nodes > 0 and max_depth > 0:
        offer(root, -1, 1.0, 0)
    inner = set()
    while heap and len(nodes) < max_nodes:
        negv, _, tok, parent, handle, depth, p, key = heapq.heappop(heap)
        nodes.append((tok, parent, p, key))
        inner.add(parent)
        if depth < max_depth:
            offer(handle, len(nodes) - 1, -negv, depth)
    chains = []
    for leaf in range(len(nodes)):
        if leaf in inner:
            continue
        path, n = [], leaf
        while n >= 0:
            path.append(nodes[n])
            n = nodes[n][1]
        path.reverse()
        chains.append(Chain([x[0] for x in path], [x[2] for x in path], source, [x[3] for x in path]))
    return chains


# calibration of a model drafter's probabilities (kept in the learned state, read by the drafter)
_BINS = 10


def calibration_bin(p: float) -> int:
    return min(_BINS - 1, max(0, int(p * _BINS)))


def new_calibration() -> Estimates:
    """P(the target agrees | the draft's probability for the token), per probability bin. Prior: a token drafted
    with probability p is accepted with probability ~0.8 p; slow forgetting (the text and the skip set change)."""
    return Estimates([0.8 * (b + 0.5) / _BINS for b in range(_BINS)], weight=2.0, decay=0.99)
