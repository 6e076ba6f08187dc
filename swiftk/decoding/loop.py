"""The speculative round, whatever drafts, split around its one target pass (:class:`Decoder`):

  plan    gather proposals (a model drafter's levels, free sources' chains) -> build the tree the gate says pays
          -> the pass it needs: a verify pass over the tree, or one plain step when nothing pays
          (a call's first passes are its prompt's prefill)
  finish  accept (blind to who drafted) -> commit -> each source learns from its nodes

Every call is driven by a batch (decoding/batch.py, stepped by swiftk/scheduler.py): every call's plan, then ONE
target pass over all their rows (a lone call's: its own pass), then every call's finish. The reference method is a
Decoder with no drafter and no sources: a plain step a round.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..runtime.model import Rows
from .tree import accept_nodes, accept_tree
from .budget import SourceBudget
from .gate import ALONE, Beside
from ..proposers.base import Context, Drafter, Proposer
from .session import Session
from .tree import Chain, Tree, build_tree


@dataclass
class Pass:
    """The target pass a round needs: its rows, and what finishing the round reads."""

    kind: str                      # "prefill", "plain" or "verify"
    rows: Rows
    phase: str = "accelerate"      # the drafter's phase this round (stats)
    tree: Optional[Tree] = None    # verify: the tree
    levels: list = field(default_factory=list)   # verify: the model drafter's levels
    t_draft: float = 0.0           # host seconds the round's proposals took
    solo: bool = False             # it cannot share a pass: a KVQ verify starts from the draft's kept residual
    final: Optional[torch.Tensor] = None   # the pass's final residual [rows, D], where the drafter reads it


class Decoder:
    """One call's decoding with ``drafter`` (a model drafter: proposers.layerskip.LayerSkipDraft, moa's, or None)
    and the free ``sources`` (proposers.base.FreeSource), one round at a time."""

    def __init__(self, s: Session, drafter: Optional[Drafter], sources: list[Proposer], reference: bool = False):
        """``reference``: the reference method's rounds (plain steps), which read and write nothing learned: not
        even the cost model's step time."""
        self.s, self.drafter, self.sources, self.reference = s, drafter, sources, reference
        self.owners = {src.name: src for src in sources}
        if s.grammar is not None:   # its forced tokens are a chain of the tree too
            self.owners[s.grammar.name] = s.grammar
        self.learners = [src for src in sources if src.learns]   # Token Recycling: the target's scores after each token
        if drafter is not None:
            self.owners[drafter.name] = drafter
        # sources whose host time buys nothing: probed
        self.budget = SourceBudget((src.name for src in sources), s.gate.auto)

    @property
    def done(self) -> bool:
        return self.s.done

    def plan(self, prefill_limit: int = 0, alone: bool = True, beside: Beside = ALONE) -> Pass:
        """Everything of the next round before its target pass. While the prompt is not all in the cache: its
        next chunk (``prefill_limit`` rows at most, 0: the rest). Not ``alone`` (other calls share the pass): no
        model drafter runs, as its draft and search passes, its own, would hold up every call of the batch.
        ``beside``: the rest of the pass, which the tree's nodes are priced against."""
        s = self.s
        if s.prefilling:
            return Pass("prefill", s.prefill_rows(prefill_limit))
        drafter, gate = self.drafter, s.gate
        t = s.begin_round()
        active = None if drafter is None or not alone or drafter.resting(gate, s.model.device) else drafter
        dc = s.draft_context() if active is not None else None   # the round's view, for the search and the draft
        phase, found = active.optimize(dc) if active is not None else ("accelerate", None)
        if found is not None:
            s.searched(t, found)
        self.budget.start_round()
        t = time.perf_counter()
        levels, chains = [], []
        if s.measured:   # an engine's first round is a plain step: it times one, so drafts can be priced
            ctx = Context(s.tokens, min(s.cfg.max_draft, s.max_nodes - 1), gate.value_floor)
            chains = [c for src in self.sources if src.name in self.budget.on
                      for c in as_chains(self.budget.timed(src.name, src.propose, ctx))]
            if s.grammar is not None:   # what the grammar refuses is never verified; what it forces always is
                forced = s.grammar.propose(ctx.k)
                chains = ([forced] if forced is not None else []) + s.grammar.clip(chains)
            if active is not None:   # after the free chains: a drafter may leave a round to them (draft_model)
                dc.chains = chains
                levels = active.propose(dc)
        t_draft = time.perf_counter() - t
        tree = None
        if levels or chains:
            size = gate.tree_size if levels else gate.free_size
            tree = build_tree(s.tokens[-1], levels, s.cache.length, s.max_nodes, s.model.device, chains=chains,
                              calibrate=drafter.calibrate if levels and gate.auto else (lambda p: p),
                              choose_size=lambda vals: size(t_draft, vals, beside) if gate.auto or not levels
                              else len(vals))
        if levels:
            drafter.observe_cost(t_draft / len(levels))
        s.timer.add("draft", t)
        if tree is None:   # nothing worth verifying: one plain step
            return Pass("plain", s.step_rows(), phase, levels=levels, t_draft=t_draft)
        n, N = s.cache.length, tree.size
        rows = Rows(tree.tokens, n + tree.depth, torch.arange(n, n + N, device=s.model.device), s.cache, tree.mask)
        boundary = drafter.boundary if levels else None
        return Pass("verify", rows, phase, tree, levels, t_draft, solo=boundary is not None)

    def run(self, p: Pass):
        """The pass alone: its logits (all rows a verify or plain pass reads; a prefill's last row). Where the
        drafter reads the final hidden state, the pass keeps it (``p.final``: the residual after the last layer)."""
        s, r = self.s, p.rows
        if p.kind == "verify" and p.levels and self.drafter.boundary is not None:
            return verify(s.model, s.cache, p.tree, p.levels, self.drafter.boundary)
        final = s.model.cfg.n_layers if self.drafter is not None and self.drafter.reads_final else None
        if p.kind == "verify":
            out = s.model.forward(r.tokens, r.positions, r.slots, s.cache, attn_mask=r.mask, capture_layer=final)
        elif p.kind == "plain":
            out = s.model.forward(r.tokens, r.positions, r.slots, s.cache, start=s.cache.length, capture_layer=final)
        else:
            out = s.model.forward(r.tokens, r.positions, r.slots, s.cache, logits_idx=r.logits_idx,
                                  capture_layer=final)
        if final is None:
            return out
        logits, p.final = out
        return logits

    def finish(self, p: Pass, logits, seconds: float, timed: bool = True) -> None:
        """Everything of the round after its pass (``seconds`` long; ``timed``: the round's own pass, which the cost
        model learns from; in a batch the scheduler times its passes)."""
        s, gate, costs, budget, drafter = self.s, self.s.gate, self.s.costs, self.budget, self.drafter
        if p.kind == "prefill":
            s.prefilled(p.rows, logits)
            s.timer.totals["prefill"] = s.timer.totals.get("prefill", 0.0) + seconds
            self._hand_final(p, -1)
            return
        if p.kind == "plain":
            self._hand_final(p, 0)
            root = s.tokens[-1]
            s.timer.totals["verify"] = s.timer.totals.get("verify", 0.0) + seconds
            s.stepped(logits, p.phase, seconds, timed and not self.reference)
            learn(budget, self.learners, [root], logits, [0])
            budget.end_round({}, costs.step or 0.0)
            if p.levels:   # drafted, but no node was worth verifying: a round slower than a plain step
                gate.drafted(costs.v(1) / (len(p.levels) * drafter.step_cost() + costs.v(1)))
            return
        t = time.perf_counter()
        tree, levels = p.tree, p.levels
        nodes, bonus = accept(s, tree, logits)
        self._hand_final(p, nodes[-1])
        learn(budget, self.learners, [tree.host_tokens[i] for i in nodes], logits, nodes)
        s.timer.totals["verify"] = s.timer.totals.get("verify", 0.0) + seconds
        t_verify = seconds + s.timer.add("verify", t) - t
        if timed:
            costs.observe_verify(tree.size, t_verify)
        hits: dict = {}
        for i, hit in tree.outcomes(nodes):
            self.owners[tree.source[i]].observe(tree.key[i], hit)
            hits[tree.source[i]] = hits.get(tree.source[i], 0) + hit
        budget.end_round(hits, costs.step or 0.0)
        if gate.probing:
            gate.probed(len(nodes) > 1)
        if levels:   # the round's speed in plain-step units, priced by the cost model
            gate.drafted(len(nodes) * costs.v(1) / (len(levels) * drafter.step_cost() + costs.v(tree.size)))
        else:
            gate.free_measured(len(nodes), tree.size)
        t = time.perf_counter()
        s.commit(tree, nodes, bonus, p.phase, p.t_draft, t_verify, len(levels), logits)
        s.timer.add("other", t)

    def _hand_final(self, p: Pass, row: int) -> None:
        """The final residual of the row whose logits chose the next root token, to a drafter that reads it (None
        after a pass that kept none: a shared one)."""
        if self.drafter is not None and self.drafter.reads_final:
            self.drafter.take_final(None if p.final is None else p.final[row:row + 1 if row != -1 else None])

    def close(self):
        """The call's DecodeStats."""
        if self.drafter is not None:
            self.drafter.finish(self.s.stats)
        return self.s.finish()


def accept_constrained(s: Session, tree, logits) -> tuple:
    """accept() under a grammar: from the root, the row of the node reached chooses among what the grammar allows
    there (Session.choose, which advances the grammar); the walk moves to the child holding that token, else the
    token is the bonus. Only the rows of emitted tokens are masked."""
    children: dict = {}
    for i in range(1, tree.size):
        children.setdefault(tree.host_parents[i], []).append(i)
    n, path = s.cache.length, [0]
    while True:
        t = s.choose(logits[path[-1]:path[-1] + 1], n + len(path))
        nxt = next((c for c in children.get(path[-1], ()) if tree.host_tokens[c] == t), None)
        if nxt is None:
            return path, t
        path.append(nxt)


def learn(budget, learners: list, tokens: list, logits, rows: list) -> None:
    """The target's scores to the sources that learn from them (Token Recycling), those consulted this round:
    ``tokens[i]`` was read, row ``rows[i]`` of ``logits`` scored what follows it."""
    for src in learners:
        if src.name in budget.on:
            budget.timed(src.name, src.learn, tokens, logits, rows)


def as_chains(proposal) -> list:
    """A source's proposal as a list of non-empty chains (it may return one Chain, a list of them, or None)."""
    if proposal is None:
        return []
    if isinstance(proposal, Chain):
        return [proposal] if proposal.tokens else []
    return [c for c in proposal if c is not None and c.tokens]


def verify(model, cache, tree, levels: list, boundary) -> torch.Tensor:
    """One target pass over the tree -> logits [N, vocab].

    With a KVQ ``boundary`` f, the spine nodes the draft already ran start at layer f from their kept residual
    (their KV below f is in place); only the other nodes run layers [0, f), attending to the prefix and their
    ancestors, before all nodes run layers [f, L) together."""
    n, N, dev = tree.mask.prefix_len, tree.size, model.device
    slots = torch.arange(n, n + N, device=dev)
    pos = n + tree.depth
    if boundary is None:
        return model.forward(tree.tokens, pos, slots, cache, attn_mask=tree.mask)
    ns = tree.n_spine
    h = torch.empty(N, model.cfg.hidden_size, dtype=model.dtype, device=dev)
    h[:ns] = torch.cat([levels[j].hidden for j in range(ns)])
    if ns < N:
        mask = tree.mask.dense(rows=slice(ns, N))
        h[ns:] = model.forward_to(boundary, tree.tokens[ns:], pos[ns:], slots[ns:], cache, attn_mask=mask)
    return model.forward_from(boundary, h, pos, slots, cache, attn_mask=tree.mask)


def accept(s: Session, tree, logits) -> tuple:
    """(accepted nodes root..last as a list, bonus token): greedy or coupled sampling on the target's scores, or
    tree rejection sampling (sampling="rejection") against the draft's distributions."""
    if s.grammar is not None:
        return accept_constrained(s, tree, logits)
    if s.rejection:
        path, bonus = accept_tree(tree, s.sampler.sp.probs(logits), "rejection", s.sampler.generator)
        return path.tolist(), bonus
    scores = logits if s.sampler.greedy else s.sampler.scores(logits, (s.cache.length + 1 + tree.depth).tolist())
    return accept_nodes(tree, scores)
