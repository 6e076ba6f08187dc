"""SWIFT decoding: one round = (optimization step) -> draft with the skip set -> tree -> one verify pass ->
acceptance -> KV commit.

Slot layout during a round with ``n`` committed tokens: slots [0, n) hold committed target KV; the pending token
(the root, emitted but not yet in the cache) and the tree go to slots n, n+1, ...; the optimizer's matchness pass
writes its draft KV there too. All of it is scratch until the commit moves the accepted path's KV to n, n+1, ...
and advances ``cache.length``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import torch

from .acceptance import accept_greedy, accept_sampling
from .drafter import draft
from .errors import SwiftkError
from .generate import Timer
from .ops.reference import unpack_tree_mask
from .tree import GREEDY_TOPK, SAMPLING_TOPK, build_tree


@dataclass
class SwiftConfig:
    """SWIFT knobs; defaults are the paper's (DESIGN.md)."""

    skip_ratio: float = 0.45        # r: fraction of the 2*n_layers sublayers the draft skips
    context_window: int = 32        # generated tokens matchness is measured on
    max_draft: int = 25             # max draft depth per round
    eps: float = 0.8                # stop drafting when the draft's top-1 probability falls below this
    bayes_interval: int = 25        # a BO suggestion every this many optimization steps (0: random search only)
    max_opt_steps: int = 1000
    patience: int = 300             # stop optimizing after this many steps without improvement
    max_matchness: float = 0.95     # ... or once the best matchness exceeds this
    max_tree_nodes: int = 0         # verify-pass budget; 0 = measured per device at the first SWIFT call
    optimize: bool = True           # False: keep the current skip set (e.g. a loaded one)
    topk_greedy: tuple = GREEDY_TOPK
    topk_sampling: tuple = SAMPLING_TOPK
    bo_mode: str = "process"        # where GP suggestions are computed: process | thread | sync
    opt_seed: int = 0
    kvq: bool = False               # reuse the draft's exact KV/exit state below the first skipped layer (KVQ cache)

    def validate(self) -> "SwiftConfig":
        if not 0.0 < self.skip_ratio < 1.0:
            raise SwiftkError(f"skip_ratio must be in (0, 1), got {self.skip_ratio!r}")
        if not isinstance(self.context_window, int) or self.context_window < 1:
            raise SwiftkError(f"context_window must be an int >= 1, got {self.context_window!r}")
        if not isinstance(self.max_draft, int) or self.max_draft < 1:
            raise SwiftkError(f"max_draft must be an int >= 1, got {self.max_draft!r}")
        if not 0.0 <= self.eps <= 1.0:
            raise SwiftkError(f"eps must be in [0, 1], got {self.eps!r}")
        if not isinstance(self.max_tree_nodes, int) or self.max_tree_nodes < 0 or self.max_tree_nodes == 1:
            raise SwiftkError(f"max_tree_nodes must be 0 (auto) or an int >= 2, got {self.max_tree_nodes!r}")
        if self.bayes_interval < 0 or self.max_opt_steps < 0 or self.patience < 1:
            raise SwiftkError("bayes_interval and max_opt_steps must be >= 0, patience >= 1")
        if not 0.0 < self.max_matchness <= 1.0:
            raise SwiftkError(f"max_matchness must be in (0, 1], got {self.max_matchness!r}")
        for bins in (self.topk_greedy, self.topk_sampling):
            if not bins or any(int(k) < 1 for _, k in bins):
                raise SwiftkError(f"top-k bins must be non-empty (threshold, k>=1) pairs, got {bins!r}")
        return self

    @classmethod
    def from_kwargs(cls, base: "SwiftConfig", kw: dict) -> "SwiftConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(kw) - names
        if unknown:
            raise SwiftkError(f"unknown SWIFT option(s): {', '.join(sorted(unknown))}")
        vals = {f.name: getattr(base, f.name) for f in fields(cls)}
        vals.update(kw)
        return cls(**vals).validate()


def matchness(model, cache, window: list, target_next: int, skip: torch.Tensor) -> float:
    """Fraction of ``window[1:] + [target_next]`` the draft (skip set ``skip``) predicts, teacher-forced.

    ``window`` = the last W committed tokens (slots n-W .. n-1). One draft forward over them: they attend to the
    committed target KV of the prefix [0, n-W) and causally to each other, with their draft KV written to scratch
    slots n .. n+W-1 so the committed target KV is untouched.
    """
    dev = model.device
    n, W = cache.length, len(window)
    mask = torch.zeros(W, n + W, dtype=torch.bool, device=dev)
    mask[:, : n - W] = True
    mask[:, n:] = torch.ones(W, W, dtype=torch.bool, device=dev).tril()
    logits = model.forward(torch.tensor(window, device=dev), torch.arange(n - W, n, device=dev),
                           torch.arange(n, n + W, device=dev), cache, attn_mask=mask, skip=skip)
    want = torch.tensor(window[1:] + [target_next], device=dev)
    return float((logits.argmax(-1) == want).float().mean())


@dataclass
class RoundLog:
    accept_lengths: list = field(default_factory=list)   # tokens emitted per verify pass (accepted drafts + bonus)
    drafted: int = 0
    accepted: int = 0
    tree_sizes: list = field(default_factory=list)
    phases: list = field(default_factory=list)
    matchness: list = field(default_factory=list)        # (generated tokens so far, matchness, source)


def kvq_boundary(skip: torch.Tensor) -> int:
    """First layer with a skipped sublayer: below it the draft computes exactly what the target computes."""
    idx = torch.nonzero(skip.cpu()).flatten()
    return int(idx[0]) // 2 if idx.numel() else skip.shape[0] // 2


def verify(model, cache, tree, levels: list, boundary) -> torch.Tensor:
    """One target pass over the tree -> logits [N, vocab].

    With a KVQ ``boundary`` f, the spine nodes the draft already ran start at layer f from their kept residual
    (their KV below f is in place); only the other nodes run layers [0, f), attending to the prefix and their
    ancestors, before all nodes run layers [f, L) together.
    """
    n, N, dev = tree.mask.prefix_len, tree.size, model.device
    slots = torch.arange(n, n + N, device=dev)
    pos = n + tree.depth
    if boundary is None:
        return model.forward(tree.tokens, pos, slots, cache, attn_mask=tree.mask)
    ns = tree.n_spine
    h = torch.empty(N, model.cfg.hidden_size, dtype=model.dtype, device=dev)
    h[:ns] = torch.cat([levels[j].hidden for j in range(ns)])
    if ns < N:
        anc = unpack_tree_mask(tree.mask.bits, N)[ns:]
        mask = torch.cat([torch.ones(N - ns, n, dtype=torch.bool, device=dev), anc], dim=1)
        h[ns:] = model.forward(tree.tokens[ns:], pos[ns:], slots[ns:], cache, attn_mask=mask, stop_layer=boundary)
    return model.forward(tree.tokens, pos, slots, cache, attn_mask=tree.mask, start_layer=boundary, hidden=h)


def swift_decode(engine, prompt_ids: list, sp, sink, cfg: SwiftConfig, skip=None) -> dict:
    """Decode with the SWIFT loop. ``skip`` fixes the draft's skip set (early exit, static sets): no optimization."""
    model, cache = engine.model, engine.cache
    dev = model.device
    gen = sp.generator(dev)
    timer, log = Timer(), RoundLog()
    max_nodes = cfg.max_tree_nodes
    bins = cfg.topk_greedy if sp.greedy else cfg.topk_sampling
    W = cfg.context_window
    boundary_of = (None, None)  # (skip set, its KVQ boundary layer) when cfg.kvq
    if skip is not None:
        skip = skip.to(dev)

    t = time.perf_counter()
    P = len(prompt_ids)
    cache.reset()
    logits = model.forward(torch.tensor(prompt_ids, device=dev), torch.arange(P, device=dev),
                           torch.arange(P, device=dev), cache, logits_idx=torch.tensor([P - 1], device=dev))
    cache.length = P
    pending = sp.pick(logits[0], gen)
    committed = list(prompt_ids)
    steps = 1
    t = timer.add("verify", t)
    stop = sink.push(pending)

    while not stop:
        n = cache.length
        generated = n - P + 1  # tokens generated in this sequence, the pending one included
        opt = engine.optimizer if cfg.optimize and skip is None else None
        phase = "accelerate"
        if opt is not None and not opt.done:
            phase = "context"
            if generated >= W + 1:
                phase = "optimize"
                window = committed[-W:]
                if opt.best_score < 0:
                    opt.score_initial(matchness(model, cache, window, pending, engine.skip_set))
                cand, src = opt.propose()
                m = matchness(model, cache, window, pending, cand)
                opt.report(cand, m, src)
                log.matchness.append((engine.tokens_seen + len(sink.ids), m, src))
                engine.skip_set = opt.best
                t = timer.add("optimize", t)
        draft_skip = engine.skip_set_device() if skip is None else skip
        if cfg.kvq and boundary_of[0] is not draft_skip:
            boundary_of = (draft_skip, kvq_boundary(draft_skip) or None)  # 0: nothing to reuse

        levels = draft(model, cache, pending, draft_skip, sp, gen, max_draft=cfg.max_draft, eps=cfg.eps,
                       max_spine=max_nodes - 1, topk_bins=bins, boundary=boundary_of[1])
        tree = build_tree(pending, levels, n, max_nodes, dev)
        t = timer.add("draft", t)

        N = tree.size
        logits = verify(model, cache, tree, levels, boundary_of[1])
        steps += 1
        t = timer.add("verify", t)

        if sp.greedy:
            path, bonus = accept_greedy(tree.parents, tree.tokens, logits)
        else:
            path, bonus = accept_sampling(tree.parents, tree.tokens, sp.probs(logits), tree.draft_probs,
                                          replacement=False, generator=gen)
        L = path.shape[0]
        if L > tree.n_spine or not torch.equal(path, torch.arange(L, device=dev)):
            # the accepted path left the spine: move its KV next to the committed prefix
            model.ops.kv_commit(cache.data, n + path, torch.arange(n, n + L, device=dev))
        cache.length = n + L
        new = tree.tokens[path].tolist()
        committed += new
        log.accept_lengths.append(L)
        log.drafted += len(levels)
        log.accepted += L - 1
        log.tree_sizes.append(N)
        log.phases.append(phase)
        pending = bonus
        stop = sink.extend(new[1:] + [bonus])
        t = timer.add("other", t)

    engine.tokens_seen += len(sink.ids)
    return _stats(log, steps, timer, engine, max_nodes, skip)


def _stats(log: RoundLog, steps: int, timer: Timer, engine, max_nodes: int, fixed_skip=None) -> dict:
    rounds = len(log.accept_lengths)
    opt = engine.optimizer if fixed_skip is None else None
    skip = (engine.skip_set if fixed_skip is None else fixed_skip).tolist()
    return {
        "decoding_steps": steps,
        "rounds": rounds,
        "accept_lengths": log.accept_lengths,
        "mean_accepted_length": (sum(log.accept_lengths) / rounds) if rounds else 0.0,
        "acceptance_rate": (log.accepted / log.drafted) if log.drafted else 0.0,
        "drafted_tokens": log.drafted,
        "accepted_tokens": log.accepted,
        "tree_sizes": log.tree_sizes,
        "max_tree_nodes": max_nodes,
        "time_optimize_s": timer.totals.get("optimize", 0.0),
        "time_draft_s": timer.totals.get("draft", 0.0),
        "time_verify_s": timer.totals.get("verify", 0.0),
        "time_other_s": timer.totals.get("other", 0.0),
        "phases": log.phases,
        "skip_set": {"attention": [i // 2 for i in range(0, len(skip), 2) if skip[i]],
                     "mlp": [i // 2 for i in range(1, len(skip), 2) if skip[i]]},
        "matchness_history": log.matchness,
        "best_matchness": None if opt is None else opt.best_score,
        "optimization_done": None if opt is None else opt.done,
        "optimization_steps": None if opt is None else opt.steps,
    }
