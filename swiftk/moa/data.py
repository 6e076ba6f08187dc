"""The target's features over a chunk of text, computed when training needs them (teacher forcing, online).

One target pass over a chunk of T tokens (the model as it is loaded: the numerical model the drafter will draft
for) gives everything a training row reads:
  tokens [T], kv [T, L, E] (every layer's K and V as the cache holds them: the drafter's input),
  final [T, D] (final-normed hidden: what the LM head reads, the TLI = 0 target),
  resid{N} [T, D] (the residual entering layer L - N, the TLI = N target) for N in 1..max_tli.
Nothing is stored: a feature set of every layer's KV is ~23 KB a token on SmolLM2 (160 GB for 7M tokens), while
the pass that makes it costs a prefill (~0.5 ms a token there).
"""
from __future__ import annotations

import torch


@torch.inference_mode()
def chunk_features(model, ids: list, max_tli: int = 0) -> dict:
    """One target pass over one chunk -> its feature tensors (module docstring), float32 on the model's device."""
    T, L, dev = len(ids), model.cfg.n_layers, model.device
    cache = model.new_cache(T)
    pos = torch.arange(T, device=dev)
    captured, start = {}, 0
    h = model.embed_rows(torch.tensor(ids, device=dev))
    for n in range(max_tli, 0, -1):      # the residual entering layer L - n, then carry on from there
        h = model.run_layers(h, start, L - n, pos, pos, cache, None, None)[0]
        captured[n], start = h.clone(), L - n
    h, x, _ = model.run_layers(h, start, L, pos, pos, cache, None, None)
    if x is None:   # the fused CPU loop returns the residual only
        x = model.ops.rmsnorm(h, model.norm, model.cfg.rms_eps)
    kv = cache.data[:, :, :, :T].permute(3, 0, 1, 2, 4).reshape(T, L, -1)
    out = {"tokens": torch.tensor(ids, dtype=torch.long), "kv": kv.float().clone(), "final": x.float().clone()}
    for n, r in captured.items():
        out[f"resid{n}"] = r.float()
    return out


def batch_features(model, rows, max_tli: int = 0) -> dict:
    """``rows`` [B, T] of token ids -> the features of each, stacked: name -> [B, T, ...]."""
    feats = [chunk_features(model, [int(t) for t in r], max_tli) for r in rows]
    return {k: torch.stack([f[k] for f in feats]) for k in feats[0]}
