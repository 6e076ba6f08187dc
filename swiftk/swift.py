"""The speculative decode loop (SWIFT and every drafting mode). One round:

  optimization step (within its time budget) -> draft (layer-skip, while it pays) + n-gram candidates -> tree
  -> one verify pass -> acceptance -> KV commit -> statistics for the gate and the cost model

or, when the gate expects no draft to pay, one plain decode step.

Slot layout during a round with ``n`` committed tokens: slots [0, n) hold committed target KV; the pending token
(the root, emitted but not yet in the cache) and the tree go to slots n, n+1, ...; the optimizer's matchness pass
writes its draft KV there too. All of it is scratch until ``cache.commit`` moves the accepted path's KV to
n, n+1, ... and advances the committed length.
"""
from __future__ import annotations

import math
import time

import torch

from .acceptance import accept_tree
from .costs import CostModel, Gate
from .drafter import draft, matchness
from .generate import DecodeStats, Sampler, Timer, plain_step, prefill
from .moa.runner import moa_draft
from .datastore import MAX_N as CORPUS_N
from .ngram import NgramIndex
from .skipset import kvq_boundary, to_layers
from .state import SkipSetState
from .tree import DATASTORE, DRAFT, HISTORY, NGRAM, SOURCE_NAMES, Chain, build_tree


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


def optimization_step(model, cache, state: SkipSetState, costs: CostModel, window: list, pending: int,
                      head=None) -> tuple:
    """Score one candidate skip set on the window (and the incumbent, when a challenger is being re-scored).
    Returns (matchness, source, passes run)."""
    opt, dev = state.optimizer, model.device
    speed = state.cfg.objective == "speed"

    def score(m, s):
        return costs.expected_rate(m, s) if speed else m

    def match(s):
        return matchness(model, cache, window, pending, s, head)

    passes = 0
    if opt.best_score < 0:
        m0 = match(state.skip_set_on(dev))
        opt.score_initial(score(m0, state.skip_set), m0)
        passes += 1
    cand, src = opt.propose()
    m = match(cand.to(dev))
    inc = None
    if src == "rescore":
        mi = match(state.skip_set_on(dev))
        inc = score(mi, state.skip_set)
        passes += 1
    opt.report(cand, m, score(m, cand), src, incumbent_score=inc)
    return m, src, passes + 1


def swift_decode(model, cache, state: SkipSetState, costs: CostModel, prompt_ids: list, sampler: Sampler, sink,
                 cfg, *, skip=None, head=None, layer_draft: bool = True, moa=None, datastore=None) -> DecodeStats:
    """Decode with the speculative loop. ``skip`` fixes the draft's skip set (early exit, static sets: no
    optimization); ``layer_draft=False`` drafts from context n-grams only (method "ngram"); ``head``: a factory
    of the reduced-vocabulary draft head (vocab.DraftHead), called at the first draft, or None for the full LM
    head. ``moa``: a moa.MoARunner, the trained MoA drafter in place of the layer-skip draft. ``datastore``: a
    datastore.Datastore whose corpus n-grams join the tree beside the context's (free drafts). ``state`` is read
    and updated (skip-set search, acceptance statistics); nothing else outside the
    arguments is touched."""
    dev = model.device
    st, timer, gate = DecodeStats(), Timer(), Gate(costs, state.stats, cfg)
    state.stats.new_text()
    layer_draft = layer_draft and moa is None
    opt = state.optimizer if (cfg.optimize and skip is None and layer_draft) else None
    W = state.cfg.context_window
    rejection = not sampler.greedy and cfg.sampling == "rejection"
    bins = cfg.topk_greedy if sampler.greedy else cfg.topk_sampling
    max_nodes = cfg.max_tree_nodes or (64 if gate.auto else costs.budget())
    use_ngram = cfg.ngram and not rejection   # free drafts are deterministic: rejection sampling has no rule for them
    history = state.history if cfg.history and not rejection and len(state.history) else None
    # the context index; the history is looked up with the context's tail, which the index holds
    index = NgramIndex(prompt_ids) if use_ngram or history is not None else None
    corpus = datastore if cfg.datastore and not rejection else None
    calibrate = state.stats.calibrate if gate.auto else (lambda p: p)
    boundary_of = (None, None)  # (skip set, its KVQ boundary layer) when cfg.kvq
    P = len(prompt_ids)
    st.accepted_by_source = {"draft": 0, "ngram": 0, "history": 0, "datastore": 0}
    make_head, head = head, None

    t_start = t = time.perf_counter()
    pending = prefill(model, cache, prompt_ids, sampler)
    committed = list(prompt_ids)
    if index is not None:   # the index holds committed + pending: its proposals continue *after* the tree's root
        index.extend([pending])
    if moa is not None:
        moa.reset()
    st.decoding_steps = 1
    t = timer.add("verify", t)
    stop = sink.push(pending)

    while not stop:
        n = cache.length
        phase = "accelerate"
        if opt is not None and not opt.done:
            phase = "context"
            elapsed = state.time_decode_s + (t - t_start)
            if n - P + 1 >= W + 1 and state.time_optimize_s + (costs.opt or costs.v(W)) \
                    <= _budget(state) * elapsed:
                phase = "optimize"
                head = head if head is not None else _build_head(make_head, committed)
                m, src, passes = optimization_step(model, cache, state, costs, committed[-W:], pending, head)
                st.matchness_history.append((state.tokens_seen + len(sink.ids), m, src))
                now = time.perf_counter()
                state.time_optimize_s += now - t
                costs.observe_opt((now - t) / passes)
                t = timer.add("optimize", t)
        draft_skip = state.skip_set_on(dev) if skip is None else skip
        if cfg.kvq and layer_draft and boundary_of[0] is not draft_skip:
            boundary_of = (draft_skip, kvq_boundary(draft_skip) or None)  # 0: nothing to reuse

        # ---- draft: layer-skip chain + siblings (when it is expected to pay), n-gram chain (free)
        levels = []
        measured = costs.step is not None   # the first round of an engine is a plain step: it measures one
        draft_s = costs.moa_draft() if moa is not None else costs.draft(draft_skip)  # seconds per draft token
        if measured and moa is not None and gate.should_draft():
            head = head if head is not None else _build_head(make_head, committed)
            levels = moa_draft(model, cache, moa, committed, pending, sampler, gate, draft_s, max_draft=cfg.max_draft,
                               max_spine=max_nodes - 1, topk_bins=bins,
                               head=None if head is None else head.logits_full, rejection=rejection)
        elif measured and layer_draft and _set_may_pay(opt, costs, draft_skip, gate) and gate.should_draft():
            head = head if head is not None else _build_head(make_head, committed)
            levels = draft(model, cache, pending, draft_skip, sampler, gate, max_draft=cfg.max_draft,
                           max_spine=max_nodes - 1, topk_bins=bins, boundary=boundary_of[1],
                           head=None if head is None else head.logits_full,
                           rejection=rejection)
        chains, meta = [], {}   # free drafts (no model call), and per source what its estimate is keyed by
        k, floor = min(cfg.max_draft, max_nodes - 1), gate.value_floor
        if index is not None and measured:
            props = index.propose(k) if use_ngram else None
            if props:
                p = state.stats.ngram_prob(props[0].n)
                chains.append(Chain(props[0].tokens[:_useful(p, k, floor)], [p] * k, NGRAM))
                meta[NGRAM] = props[0].n
            if history is not None:
                hp = history.propose(index.tokens[-history.max_n:], k)
                if hp is not None:
                    p = state.stats.history_prob(hp.n)
                    chains.append(Chain(hp.tokens[:_useful(p, k, floor)], [p] * k, HISTORY))
                    meta[HISTORY] = hp.n
        if corpus is not None and measured:
            ds, ds_b = corpus.propose(committed[1 - CORPUS_N:] + [pending], k, state.stats.datastore_prob, floor)
            if ds:
                chains.append(Chain(ds, [state.stats.datastore_prob(b) for b in ds_b], DATASTORE))
                meta[DATASTORE] = ds_b
        t_draft = time.perf_counter() - t
        tree = None
        if levels or chains:
            tree = build_tree(pending, levels, n, max_nodes, dev, chains=chains, calibrate=calibrate,
                              choose_size=lambda vals: gate.ngram_size(t_draft, vals) if not levels
                              else gate.tree_size(t_draft, vals) if gate.auto else len(vals))
        if levels and moa is not None:
            costs.observe_moa(t_draft / len(levels))
            draft_s = costs.moa_draft()
        elif levels:
            costs.observe_draft(draft_skip, t_draft / len(levels))
            draft_s = costs.draft(draft_skip)
        t = timer.add("draft", t)

        if tree is None or tree.size == 1:
            # ---- plain step: the cheapest way to the next token when no draft pays
            t0 = t
            nxt = plain_step(model, cache, pending, sampler)
            committed.append(pending)
            if index is not None:
                index.extend([nxt])
            if head is not None:
                head.add([pending])
            pending = nxt
            st.decoding_steps += 1
            st.plain_steps += 1
            st.phases.append("plain" if phase == "accelerate" else phase)
            stop = sink.push(pending)
            t = timer.add("verify", t)
            costs.observe_step(t - t0)
            if levels:  # drafted, but no node was worth verifying: a round slower than a plain step
                gate.drafted(costs.v(1) / (len(levels) * draft_s + costs.v(1)))
            continue

        # ---- verify, accept, commit
        N, t0 = tree.size, t
        logits = verify(model, cache, tree, levels, boundary_of[1] if levels and layer_draft else None)
        if rejection:
            path, bonus = accept_tree(tree, sampler.sp.probs(logits), "rejection", sampler.generator)
        else:
            scores = sampler.scores(logits, (n + 1 + tree.depth).tolist()) if not sampler.greedy else logits
            path, bonus = accept_tree(tree, scores)
        st.decoding_steps += 1
        t = timer.add("verify", t)
        costs.observe_verify(N, t - t0)

        cache.commit(path, tree.n_spine)
        sampler.release(cache.length)
        L = path.shape[0]
        new = tree.tokens[path].tolist()
        committed += new
        if index is not None:
            index.extend(new[1:] + [bonus])   # new[0] is the old root, indexed already
        if head is not None:
            head.add(new)
        _learn(state, tree, path.tolist(), meta, st)
        if state.stats.ng_probing:
            gate.ngram_probed(L > 1)
        if levels:  # the round's speed in plain-step units, priced by the (measured, smoothed) cost model
            gate.drafted(L * costs.v(1) / (len(levels) * draft_s + costs.v(N)))
        if len(st.expected_vs_measured) < 4096:
            expect = (1.0 + sum(tree.value[1:])) / (t_draft + costs.v(N))
            st.expected_vs_measured.append((round(expect, 3), round(L / max(t_draft + t - t0, 1e-9), 3)))
        st.accept_lengths.append(L)
        st.drafted_tokens += len(levels) + sum(1 for x in tree.source if x > DRAFT)  # spine + free
        st.accepted_tokens += L - 1
        st.tree_sizes.append(N)
        st.phases.append(phase)
        st.rounds += 1
        pending = bonus
        stop = sink.extend(new[1:] + [bonus])
        t = timer.add("other", t)

    state.tokens_seen += len(sink.ids)
    state.time_decode_s += time.perf_counter() - t_start
    st.max_tree_nodes = max_nodes
    st.time_optimize_s = timer.totals.get("optimize", 0.0)
    st.time_draft_s = timer.totals.get("draft", 0.0)
    st.time_verify_s = timer.totals.get("verify", 0.0)
    st.time_other_s = timer.totals.get("other", 0.0)
    st.skip_set = to_layers((state.skip_set if skip is None else skip).cpu()) if layer_draft else None
    if skip is None and layer_draft:
        o = state.optimizer
        st.best_matchness, st.optimization_done, st.optimization_steps = o.best_matchness, o.done, o.steps
        st.longest_bo_stall_ms = o.longest_stall_s * 1e3
        st.bo_errors = list(o.bo_errors)
    st.costs = costs.to_dict()
    return st.finish()


def _useful(p: float, k: int, floor: float) -> int:
    """Tokens of a chain whose every token is accepted with chance p (given its parent) worth building: the
    d with p^d >= floor (at most k), and always the first -- the gate's probes verify a declined chain's first
    token now and then, which is how an estimate that fell below the floor learns that the text changed."""
    if floor <= 0.0 or p >= 1.0:
        return k
    if p <= 0.0:
        return min(k, 1)
    return max(min(k, 1), min(k, int(math.log(floor) / math.log(p) + 1e-9)))


def _build_head(make_head, committed: list):
    """The reduced-vocabulary draft head, built at first use and seeded with the whole context so far."""
    if make_head is None:
        return None
    head = make_head()
    head.add(committed)
    return head


def _set_may_pay(opt, costs: CostModel, skip: torch.Tensor, gate) -> bool:
    """While the search runs, its measurement of the incumbent (matchness on recent windows) predicts what
    drafting with it would give: below plain speed, the loop does not draft (nor probe) with it -- the matchness
    passes are the cheaper probes, and drafting resumes as soon as the search finds a set that is expected to pay.
    Fixed skip sets, a finished search (the gate's own probes take over) and speculate="always" draft as before."""
    if opt is None or opt.done or not gate.auto:
        return True
    # no measurement yet (a cold start's first context window): plain steps and n-grams until the first one
    return opt.best_matchness is not None and costs.expected_rate(opt.best_matchness, skip) >= 1.0


_EXPLORE = 4  # optimization steps at half the budget before a search that found no paying set is scaled back


def _budget(state: SkipSetState) -> float:
    """Optimization's share of wall time. The search is an investment: its first few candidates are looked at
    with half the budget (on CPUs no skip set has paid yet, and at the full budget those first passes cost the
    first prompts of a session 3-7% of their time: SmolLM2 MT-Bench writing); a set expected to beat plain
    decoding earns the full budget; once none has after those first candidates, a fifth keeps looking (the text
    may change)."""
    o, b = state.optimizer, state.cfg.opt_budget
    if state.cfg.objective != "speed" or o.best_score >= 1.0:
        return b
    return b / 2 if o.steps < _EXPLORE else b / 5


def _learn(state: SkipSetState, tree, path: list, meta: dict, st: DecodeStats) -> None:
    """Acceptance statistics: every node whose parent was reached either was accepted or not. ``meta``: per free
    source what its estimate is keyed by (match length; for the corpus one bucket per depth)."""
    on = set(path)
    par = tree.parents.tolist()
    depth = tree.depth.tolist() if DATASTORE in meta else None   # a corpus node at depth d is meta[DATASTORE][d - 1]
    for i in range(1, tree.size):
        if par[i] in on:
            hit = i in on
            if tree.source[i] == DRAFT:
                state.stats.observe(tree.prob[i], hit)
            elif tree.source[i] == NGRAM:
                state.stats.observe_ngram(meta[NGRAM], hit)
            elif tree.source[i] == HISTORY:
                state.stats.observe_history(meta[HISTORY], hit)
            elif tree.source[i] == DATASTORE:
                state.stats.observe_datastore(meta[DATASTORE][depth[i] - 1], hit)
    for i in path[1:]:
        st.accepted_by_source[SOURCE_NAMES[tree.source[i]]] += 1
