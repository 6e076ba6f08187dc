"""What every model drafter shares (``ModelDrafter``) and its draft loop (``draft_chain``: layer skip, MoA, a draft
model), the layer-skip step (``draft``: the target model itself run with a skip set, one token at a time), and
matchness, the skip-set search's measure of how well a set drafts.

Draft steps read the committed target KV for the prefix and write their own KV (for the sublayers they compute)
into scratch slots past the committed length; the verify pass overwrites those slots, so nothing is copied or
cloned. After each step the gate (decoding.gate.Gate) decides whether one more draft token is worth its cost.

KVQ cache (``boundary=f``): every sublayer before layer f is computed by the draft exactly as the target computes
it, so the KV it writes there for the spine tokens is the target's own, and the residual entering layer f (the
exit query) is kept per spine token; the verify pass then starts those tokens at layer f (decoding/loop.py's verify).
"""
from __future__ import annotations

import torch

from ..errors import SwiftkError
from ..sample.logits import sample_without_replacement
from .base import DraftLevel, calibration_bin, k_for_confidence


class ModelDrafter:
    """What every model drafter shares: the calibration of its draft probabilities (kept in the learned state)
    and the draft head, topped up with the committed tokens. Subclasses implement ``propose``, ``step_cost``,
    ``observe_cost``, and where they have them ``optimize`` (a search step) and ``finish`` (stats)."""

    name, boundary, reads_final = "draft", None, False

    def __init__(self, state, head):
        self.state, self.head, self.head_seen = state, head, 0

    def optimize(self, dc) -> tuple:
        """A search step where the drafter has one: (the round's phase, None or what the step found for the
        trace: tokens seen, matchness, the candidate's source)."""
        return "accelerate", None

    def resting(self, gate, device) -> bool:
        """Whether this round would neither search nor draft (the loop then skips the drafter altogether)."""
        return False

    def take_final(self, h) -> None:
        """The final residual of the row that chose the next root token (only where ``reads_final``)."""

    def calibrate(self, p: float) -> float:
        return self.state.calibration.prob(calibration_bin(p))

    def observe(self, p: float, hit: bool) -> None:
        self.state.calibration.observe(calibration_bin(p), hit)

    def finish(self, stats) -> None:
        stats.skip_set = None

    def _head(self, tokens: list):
        """The draft head (or None), its vocabulary topped up with the committed tokens."""
        if self.head is not None:
            self.head.add(tokens[self.head_seen:-1])
            self.head_seen = len(tokens) - 1
        return self.head


def draft(model, cache, root_token: int, skip, sampler, gate, calibrate, step_s: float, *, max_draft: int,
          max_spine: int, topk_bins, boundary=None, head=None, rejection: bool = False) -> list:
    """One DraftLevel per drafted depth (level j = candidates for the child of spine node j, and with
    ``boundary`` the residual of spine node j entering that layer). ``skip``: a skipset.SkipSet;
    ``calibrate``: draft probability -> acceptance chance; ``step_s``: seconds per draft step."""
    dev = model.device
    n = cache.length
    pos = torch.empty(1, dtype=torch.long, device=dev)

    def step(token: int, j: int) -> tuple:
        pos.fill_(n + j)
        out = model.forward(torch.tensor([token], device=dev), pos, pos, cache, skip=skip, capture_layer=boundary,
                            head=head, start=n + j)
        if boundary is not None:
            out, hidden = out
            return out[0], hidden
        return out[0], None

    return draft_chain(step, n, root_token, sampler, gate, calibrate, step_s, max_draft=max_draft,
                       max_spine=max_spine, topk_bins=topk_bins, rejection=rejection)


def draft_chain(step, n: int, root_token: int, sampler, gate, calibrate, step_s: float, *, max_draft: int,
                max_spine: int, topk_bins, rejection: bool = False, vocab_ids=None) -> list:
    """The draft loop every model drafter shares (layer skip, MoA): ``step(token, j)`` runs the drafter on the
    spine token at depth j (position n + j) and returns (logits [V] for the next token, the boundary residual or
    None); candidates are ranked per depth and the gate decides after each one whether to draft another.
    ``vocab_ids`` (greedy only): the logits are over these token ids, a draft vocabulary, not the whole one."""
    levels = []
    cur = root_token
    kmax = max(k for _, k in topk_bins)
    surv, tokens = 1.0, 1.0   # chain survival and expected emitted tokens so far (the gate's bookkeeping)
    for j in range(min(max_draft, max_spine)):
        logits, hidden = step(cur, j)
        level, conf = draft_level(logits, sampler, n + j + 1, topk_bins, kmax, rejection, vocab_ids)
        level.hidden = hidden
        levels.append(level)
        a = calibrate(conf)
        surv *= a
        tokens += surv
        if not gate.keep_drafting(j + 1, conf, a, surv, tokens, step_s):
            break
        cur = level.tokens[0]
    return levels


def draft_level(logits: torch.Tensor, sampler, pos: int, topk_bins, kmax: int, rejection: bool,
                vocab_ids=None) -> tuple:
    """Draft logits [V] for the token at position ``pos`` -> (DraftLevel of candidates, top-1 confidence).
    Shared by every drafter (layer skip, MoA): how candidates are ranked decides what sampling acceptance needs.
    ``vocab_ids``: see :func:`draft_chain`."""
    if sampler.greedy:
        top_p, top_i = torch.topk(torch.softmax(logits.float(), dim=-1), min(kmax, logits.shape[-1]))
        if vocab_ids is not None:
            top_i = vocab_ids[top_i]
        top_p, top_i = top_p.tolist(), top_i.tolist()      # one small host read per step
        conf = top_p[0]
        k = k_for_confidence(conf, topk_bins)
        return DraftLevel(tokens=top_i[:k], probs=top_p[:k]), conf
    if vocab_ids is not None:
        raise SwiftkError("a draft over a subset of the vocabulary ranks greedily only")
    q = sampler.sp.probs(logits)
    if rejection:
        conf = float(q.max())
        k = min(k_for_confidence(conf, topk_bins), int((q > 0).sum()))
        # children drawn without replacement from q; acceptance uses the matching conditional
        toks = sample_without_replacement(q, k, sampler.generator).tolist()
        return DraftLevel(tokens=toks, probs=q[toks].tolist(), dist=q), conf
    # coupled sampling: the draft ranks tokens by the same Gumbel-perturbed score the target will use
    sc = sampler.coupled(torch.log(q), pos)
    k = min(kmax, int((q > 0).sum()))
    top_s, top_i = torch.topk(sc, k)
    top_i = top_i.tolist()
    qs = q[top_i].tolist()
    conf = qs[0]
    k = k_for_confidence(conf, topk_bins)
    return DraftLevel(tokens=top_i[:k], probs=qs[:k]), conf


def matchness(model, cache, window: list, target_next: int, skip: torch.Tensor, head=None) -> float:
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
                           torch.arange(n, n + W, device=dev), cache, attn_mask=mask, skip=skip,
                           head=None if head is None else head.logits_full)  # the head the draft will use
    want = torch.tensor(window[1:] + [target_next], device=dev)
    return float((logits.argmax(-1) == want).float().mean())
