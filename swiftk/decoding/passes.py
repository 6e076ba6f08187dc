"""The plain target passes: a prompt's rows (``prefill_rows``) and a plain step's (``step_rows``) for the round
(loop.py), a whole sequence's logits (reference checks) and the load-time timing passes; ``prefill``,
``plain_step`` and ``autoregressive`` are the bare loop a benchmark compares the round with (bench.driver_overhead).
The round's verify pass is loop.py's; with these, the only target passes in the package."""
from __future__ import annotations

import time

import torch

from ..errors import SwiftkError
from ..runtime.model import Rows
from .output import DecodeStats, TokenSink
from ..sample.sampler import Sampler

def prefill(model, cache, prompt_ids: list, sampler: Sampler, reuse: int = 0) -> int:
    """Target pass over the prompt (KV into slots [0, P)); returns the first new token (not yet in the cache).
    ``reuse``: slots [0, reuse) already hold the KV of the prompt's first ``reuse`` tokens (an earlier call's): only
    the rest is computed. Exact: a row of a pass equals the same token decoded alone (batch invariance)."""
    dev = model.device
    P = len(prompt_ids)
    if not 0 <= reuse < P:
        raise SwiftkError(f"can reuse 0 to {P - 1} of a {P}-token prompt's slots, not {reuse}")
    if reuse:
        cache.truncate(reuse)
    else:
        cache.reset()
    pos = torch.arange(reuse, P, device=dev)
    logits = model.forward(torch.tensor(prompt_ids[reuse:], device=dev), pos, pos, cache,
                           logits_idx=torch.tensor([P - reuse - 1], device=dev))
    cache.advance(P - reuse)
    return sampler.pick(logits[0], P)


def prefill_rows(model, cache, prompt_ids: list, start: int, end: int) -> Rows:
    """The rows of prompt positions [start, end) (the cache holds the KV of [0, start)), causal; logits only for
    the prompt's last position, when this chunk holds it. :func:`prefill` is the whole prompt in one chunk; a
    batch (decoding/batch.py) prefills a prompt in chunks that ride along with other requests' passes."""
    dev = model.device
    pos = torch.arange(start, end, device=dev)
    last = torch.tensor([end - start - 1], device=dev) if end == len(prompt_ids) else torch.zeros(0, dtype=torch.long,
                                                                                                   device=dev)
    return Rows(torch.tensor(prompt_ids[start:end], device=dev), pos, pos, cache, None, last)


def step_rows(model, cache, token: int) -> Rows:
    """The row of one plain step: ``token`` at the next slot, causal."""
    n = cache.length
    pos = torch.tensor([n], device=model.device)
    return Rows(torch.tensor([token], device=model.device), pos, pos, cache)


def full_logits(model, cache, ids: list) -> torch.Tensor:
    """Logits [T, vocab] for every position of ``ids`` (the cache is reset, then holds their KV)."""
    dev, T = model.device, len(ids)
    cache.reset()
    ar = torch.arange(T, device=dev)
    return model.forward(torch.tensor(ids, device=dev), ar, ar, cache)


def plain_step(model, cache, token: int, sampler: Sampler) -> int:
    """One autoregressive step: ``token`` goes into the cache, the next token comes back."""
    return step_logits(model, cache, token, sampler)[0]


def step_logits(model, cache, token: int, sampler: Sampler) -> tuple:
    """:func:`plain_step` that also returns the target's scores [1, V] for the next position."""
    dev = model.device
    n = cache.length
    pos = torch.tensor([n], device=dev)
    logits = model.forward(torch.tensor([token], device=dev), pos, pos, cache, start=n)
    cache.advance(1)
    sampler.release(n + 1)
    return sampler.pick(logits[0], n + 1), logits


def autoregressive(model, cache, prompt_ids: list, sampler: Sampler, sink: TokenSink, reuse: int = 0) -> DecodeStats:
    """Plain decoding: prefill (the first ``reuse`` slots kept, see :func:`prefill`), then one target forward per
    token."""
    t = time.perf_counter()
    tok = prefill(model, cache, prompt_ids, sampler, reuse)
    t_prefill = time.perf_counter() - t
    steps = 1
    while not sink.push(tok):
        tok = plain_step(model, cache, tok, sampler)
        steps += 1
    return DecodeStats(decoding_steps=steps, plain_steps=steps - 1, time_prefill_s=t_prefill)
