"""The speculative round, whatever drafts:

  gather proposals (a model drafter's levels, free sources' chains) -> build the tree the gate says pays
  -> one verify pass -> accept (blind to who drafted) -> commit -> each source learns from its nodes

or, when nothing pays, one plain decode step.
"""
from __future__ import annotations

import time

import torch

from .acceptance import accept_nodes, accept_tree
from .costs import SourceBudget
from ..proposers.base import Context
from .session import Session
from .tree import Chain, build_tree


def speculative_decode(s: Session, drafter, sources: list):
    """Decode with ``drafter`` (a model drafter: proposers.layerskip.LayerSkipDraft, moa's, or None) and the free
    ``sources`` (proposers.base.FreeSource) until the sink stops. Returns the call's DecodeStats."""
    owners = {src.name: src for src in sources}
    learners = [src for src in sources if src.learns]   # Token Recycling: the target's scores after each token
    if drafter is not None:
        owners[drafter.name] = drafter
    costs, gate = s.costs, s.gate
    budget = SourceBudget((src.name for src in sources), gate.auto)   # sources whose host time buys nothing: probed
    s.start()
    while not s.done:
        t = s.begin_round()
        active = None if drafter is None or drafter.resting(gate, s.model.device) else drafter
        dc = s.draft_context() if active is not None else None   # the round's view, for the search and the draft
        phase, found = active.optimize(dc) if active is not None else ("accelerate", None)
        if found is not None:
            s.searched(t, found)
        budget.start_round()
        t = time.perf_counter()
        levels, chains = [], []
        if s.measured:   # an engine's first round is a plain step: it times one, so drafts can be priced
            ctx = Context(s.tokens, min(s.cfg.max_draft, s.max_nodes - 1), gate.value_floor)
            chains = [c for src in sources if src.name in budget.on
                      for c in as_chains(budget.timed(src.name, src.propose, ctx))]
            if active is not None:   # after the free chains: a drafter may leave a round to them (draft_model)
                dc.chains = chains
                levels = active.propose(dc)
        t_draft = time.perf_counter() - t
        tree = None
        if levels or chains:
            size = gate.tree_size if levels else gate.free_size
            tree = build_tree(s.tokens[-1], levels, s.cache.length, s.max_nodes, s.model.device, chains=chains,
                              calibrate=drafter.calibrate if levels and gate.auto else (lambda p: p),
                              choose_size=lambda vals: size(t_draft, vals) if gate.auto or not levels else len(vals))
        if levels:
            drafter.observe_cost(t_draft / len(levels))
        t = s.timer.add("draft", t)

        if tree is None:   # nothing worth verifying
            root = s.tokens[-1]
            logits = s.plain_step(phase)
            learn(budget, learners, [root], logits, [0])
            budget.end_round({}, costs.step or 0.0)
            if levels:   # drafted, but no node was worth verifying: a round slower than a plain step
                gate.drafted(costs.v(1) / (len(levels) * drafter.step_cost() + costs.v(1)))
            continue

        logits = verify(s.model, s.cache, tree, levels, drafter.boundary if levels else None)
        nodes, bonus = accept(s, tree, logits)
        learn(budget, learners, [tree.host_tokens[i] for i in nodes], logits, nodes)
        t_verify = s.timer.add("verify", t) - t
        costs.observe_verify(tree.size, t_verify)
        hits: dict = {}
        for i, hit in tree.outcomes(nodes):
            owners[tree.source[i]].observe(tree.key[i], hit)
            hits[tree.source[i]] = hits.get(tree.source[i], 0) + hit
        budget.end_round(hits, costs.step or 0.0)
        if gate.probing:
            gate.probed(len(nodes) > 1)
        if levels:   # the round's speed in plain-step units, priced by the cost model
            gate.drafted(len(nodes) * costs.v(1) / (len(levels) * drafter.step_cost() + costs.v(tree.size)))
        else:
            gate.free_measured(len(nodes), tree.size)
        t = time.perf_counter()
        s.commit(tree, nodes, bonus, phase, t_draft, t_verify, len(levels))
        s.timer.add("other", t)
    if drafter is not None:
        drafter.finish(s.stats)
    return s.finish()


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
    if s.rejection:
        path, bonus = accept_tree(tree, s.sampler.sp.probs(logits), "rejection", s.sampler.generator)
        return path.tolist(), bonus
    scores = logits if s.sampler.greedy else s.sampler.scores(logits, (s.cache.length + 1 + tree.depth).tolist())
    if scores.device.type == "cpu":
        return accept_nodes(tree, scores)
    path, bonus = accept_tree(tree, scores)
    return path.tolist(), bonus
