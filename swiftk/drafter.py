"""The SWIFT draft: the target model itself run with a skip set, one token at a time.

Draft steps read the committed target KV for the prefix and write their own KV (for the sublayers they compute)
into scratch slots past the committed length; the verify pass overwrites those slots, so nothing is copied or
cloned. Drafting stops when the draft's top-1 probability drops below ``eps`` or ``max_draft`` tokens are drafted.

KVQ cache (``boundary=f``): every sublayer before layer f is computed by the draft exactly as the target computes
it, so the KV it writes there for the spine tokens is the target's own, and the residual entering layer f (the
exit query) is kept per spine token; the verify pass then starts those tokens at layer f (swift.verify).
"""
from __future__ import annotations

import torch

from .sampling import sample_without_replacement
from .tree import DraftLevel, k_for_confidence


def draft(model, cache, root_token: int, skip: torch.Tensor, sp, gen, *, max_draft: int, eps: float,
          max_spine: int, topk_bins, boundary=None) -> list:
    """Returns one DraftLevel per drafted depth (level j = candidates for the child of spine node j, and with
    ``boundary`` the residual of spine node j entering that layer)."""
    dev = model.device
    n = cache.length
    levels = []
    cur = root_token
    kmax = max(k for _, k in topk_bins)
    pos = torch.empty(1, dtype=torch.long, device=dev)
    for j in range(min(max_draft, max_spine)):
        pos.fill_(n + j)
        out = model.forward(torch.tensor([cur], device=dev), pos, pos, cache, skip=skip, capture_layer=boundary)
        hidden = None
        if boundary is not None:
            out, hidden = out
        logits = out[0]
        if sp.greedy:
            probs = torch.softmax(logits.float(), dim=-1)
            top_p, top_i = torch.topk(probs, kmax)
            top_p, top_i = top_p.tolist(), top_i.tolist()      # one small host read per step
            k = k_for_confidence(top_p[0], topk_bins)
            level = DraftLevel(tokens=top_i[:k], probs=top_p[:k])
            conf = top_p[0]
        else:
            q = sp.probs(logits)
            conf = float(q.max())
            k = min(k_for_confidence(conf, topk_bins), int((q > 0).sum()))
            # children drawn without replacement from q; acceptance uses the matching conditional
            toks = sample_without_replacement(q, k, gen).tolist()
            level = DraftLevel(tokens=toks, probs=q[toks].tolist(), dist=q)
        level.hidden = hidden
        levels.append(level)
        if conf < eps:
            break
        cur = level.tokens[0]
    return levels

