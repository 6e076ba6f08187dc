"""The MoA drafter at generation time: its incremental state beside the target's KV cache, and the draft loop.

State (one owner: the MoARunner of an engine, reset per call):
  ca_k, ca_v [S, heads, hd]  cross-attention keys/values from LSA of every verified position (computed once each,
                             from the target cache's K/V of that slot: the drafter's whole input from the target)
  sa_k, sa_v [S, heads, hd]  the drafter's own self-attention K/V of verified tokens, then of the draft chain in the
                             scratch positions past them (overwritten every round, like the target's scratch slots)
``sync`` catches up on positions the target verified since the last draft (after commits and plain steps alike),
so a round costs LSA for the newly verified tokens plus one small drafter step per drafted token.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import SwiftkError
from ..proposers.draft_loop import draft_chain
from ..runtime.ops import native as native_lib
from ..runtime.ops.cpu_moa import MoAKernel
from .model import MoADrafter


class MoARunner:
    def __init__(self, drafter: MoADrafter, model, max_slots: int, native: Optional[bool] = None):
        """``native``: the draft step and the catch-up in the kernel library (kernels/cpu/cpu_moa.cpp) rather than
        torch op by op; None: where the model runs on the CPU and the library is loaded."""
        c = drafter.cfg
        c.validate(model.cfg)
        self.drafter, self.model = drafter, model
        hd = c.d // c.heads
        z = lambda: torch.zeros(max_slots, c.heads, hd, device=model.device)  # noqa: E731
        self.ca_k, self.ca_v, self.sa_k, self.sa_v = z(), z(), z(), z()
        self.n = 0   # verified positions ingested
        self.step_s = None   # seconds of one drafter step (an EMA the MoA method keeps)
        self.info: dict = {}
        self.max_slots = max_slots
        if native is None:
            native = model.device.type == "cpu" and native_lib.library() is not None
        d = drafter
        self.native = MoAKernel([d.tok_in.weight, d.sa_norm, d.sa_qkv.weight, d.sa_out.weight, d.ca_norm,
                                 d.ca_q.weight, d.ca_sink, d.ca_out.weight, d.mlp_norm, d.w_gate_up.weight,
                                 d.w_down.weight, d.out_norm, d.out.weight, d.inv_freq, d.ca_kv.weight],
                                c.hidden, c.d, c.heads, c.mlp, c.lsa_dim) if native else None

    def twin(self) -> "MoARunner":
        """A runner of its own state on the same drafter: one per batch slot, as each slot's calls decode apart."""
        other = MoARunner(self.drafter, self.model, self.max_slots, native=False)
        other.native = self.native   # the kernel's weight copy is read-only: every slot's runner shares it
        other.info = self.info
        return other

    @property
    def tli(self) -> int:
        return self.drafter.cfg.tli

    def reset(self) -> None:
        self.n = 0

    @torch.inference_mode()
    def sync(self, cache, committed: list) -> None:
        """Ingest verified positions [self.n, cache.length) (their tokens are ``committed[self.n:]``)."""
        n, m = self.n, cache.length
        if m > len(committed) or m > self.max_slots:
            raise SwiftkError(f"drafter state out of step: {m} verified positions, {len(committed)} tokens")
        if m <= n:
            self.n = m
            return
        d, dev = self.drafter, self.model.device
        # without LSA the features read the last layer only: copy just that one
        kv = cache.data[:, :, :, n:m, :] if d.cfg.lsa else cache.data[-1:, :, :, n:m, :]   # [L', 2, KV, t, hd]
        kv = kv.permute(3, 0, 1, 2, 4).reshape(m - n, kv.shape[0], -1).float()          # [t, L', E]
        feats = d.lsa_features(kv)
        emb = self.model.embed_rows(torch.tensor(committed[n:m], device=dev)).float()
        if self.native is not None:
            self.native.ingest(feats, emb, n, self.ca_k, self.ca_v, self.sa_k, self.sa_v)
        else:
            pos = torch.arange(n, m, device=dev)
            self.ca_k[n:m], self.ca_v[n:m] = d.ca_keys(feats, pos)
            _, _, self.sa_k[n:m], self.sa_v[n:m] = d.sa_kv(emb, pos)
        self.n = m

    @torch.inference_mode()
    def anchor_base(self, final) -> Optional[torch.Tensor]:
        """A round's anchor term less its depth row (its chain's steps share it), from the target's final-normed
        hidden state ``final`` [1, hidden] at position n - 1; None for a drafter without the anchor."""
        return self.drafter.anchor_base(final.float()) if self.drafter.cfg.anchor else None

    @torch.inference_mode()
    def step(self, token: int, p: int, anchor_base=None) -> torch.Tensor:
        """One drafter step for ``token`` at position p >= n (its SA K/V go to scratch position p) -> the predicted
        activation entering target layer L - TLI, [1, hidden]. ``anchor_base``: the round's :meth:`anchor_base`
        (needed where the drafter has the anchor)."""
        d, dev, n = self.drafter, self.model.device, self.n
        pos = torch.tensor([p], device=dev)
        emb = self.model.embed_rows(torch.tensor([token], device=dev)).float()
        anchor = None if not d.cfg.anchor else anchor_base + d.depth_emb[max(0, min(p - n, d.cfg.max_offset - 1))]
        if self.native is not None:
            return self.native.step(emb, p, n, self.sa_k, self.sa_v, self.ca_k, self.ca_v, anchor).to(self.model.dtype)
        x, q, k, v = d.sa_kv(emb, pos)
        self.sa_k[p], self.sa_v[p] = k[0], v[0]
        sa = F.scaled_dot_product_attention(q.transpose(0, 1), self.sa_k[: p + 1].transpose(0, 1),
                                            self.sa_v[: p + 1].transpose(0, 1))   # prefix + chain: all visible
        mask = torch.ones(1, n, dtype=torch.bool, device=dev)
        return d.finish(x, sa.transpose(0, 1).reshape(1, -1), self.ca_k[:n], self.ca_v[:n], mask, pos, anchor).to(
            self.model.dtype)


def moa_draft(model, cache, runner: MoARunner, committed: list, root_token: int, sampler, gate, calibrate,
              step_s: float, *, max_draft: int, max_spine: int, topk_bins, head=None, rejection: bool = False,
              final=None) -> list:
    """Like draft_loop.draft, with the MoA drafter: one DraftLevel per drafted depth. With TLI = N the target's last
    N layers finish each step, writing their KV for the chain into the scratch slots (verification overwrites
    them). ``head``: a proposers.draft_head.DraftHead; a greedy draft ranks its rows only (no vocabulary-long
    vector a step), a sampled one scores the rest -inf, as the target's noise is per vocabulary id. ``final``: the
    anchor's input (MoARunner.anchor_base)."""
    threads = torch.get_num_threads()
    # a drafter step is ~100 tiny torch ops: a second OpenMP thread adds only its wake-up and spin (a 3-step chain
    # on 2 Zen 3 cores: 5.8 -> 4.1 ms a step); the target's passes get the threads back
    torch.set_num_threads(1)
    try:
        return _draft(model, cache, runner, committed, root_token, sampler, gate, calibrate, step_s, max_draft,
                      max_spine, topk_bins, head, rejection, final)
    finally:
        torch.set_num_threads(threads)


def _draft(model, cache, runner, committed, root_token, sampler, gate, calibrate, step_s, max_draft, max_spine,
           topk_bins, head, rejection, final) -> list:
    runner.sync(cache, committed)
    base = None if final is None else runner.anchor_base(final)
    n, L, dev = cache.length, model.cfg.n_layers, model.device
    pos = torch.empty(1, dtype=torch.long, device=dev)
    subset = head is not None and sampler.greedy
    ids = head.ids if subset else None
    head = None if head is None else (head.logits_subset if subset else head.logits_full)

    def step(token: int, j: int) -> tuple:
        p = n + j
        h = runner.step(token, p, base)
        if runner.tli:
            pos.fill_(p)
            return model.forward_from(L - runner.tli, h, pos, pos, cache, head=head)[0], None
        return model.logits_of(h, head)[0], None

    return draft_chain(step, n, root_token, sampler, gate, calibrate, step_s, max_draft=max_draft,
                       max_spine=max_spine, topk_bins=topk_bins, rejection=rejection, vocab_ids=ids)
