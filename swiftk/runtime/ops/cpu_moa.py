"""The MoA drafter's kernels in the kernel library (kernels/cpu/cpu_moa.cpp), a thin binding: the drafter
(swiftk/moa, a plugin) hands over its tensors once, then calls ``step`` per draft token and ``ingest`` per round's
newly verified positions. Their torch twins are swiftk/moa/runner.py ``MoARunner.step`` and ``MoARunner.sync``."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.ops import native

N_WEIGHTS = 15   # cpu_moa.cpp's weight list: tok_in .. out, inv_freq, then ca_kv


def _state(tensors, rows: int, width: int) -> None:
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() or t.dim() < 2 or \
                t.shape[0] < rows or t.numel() != t.shape[0] * width:
            raise SwiftkError(f"MoA kernel: state tensors must be contiguous float32 CPU tensors [>= {rows}, {width}]")


def _vector(t, size: int, what: str) -> torch.Tensor:
    if t.device.type != "cpu" or t.numel() != size:
        raise SwiftkError(f"MoA kernel: {what} must be a CPU tensor of {size} values, got {tuple(t.shape)} on {t.device}")
    return t.to(torch.float32).contiguous()


class MoAKernel:
    def __init__(self, weights: list, hidden: int, d: int, heads: int, mlp: int, lsa_dim: int):
        """``weights``: the drafter's N_WEIGHTS tensors in cpu_moa.cpp's order (copied to contiguous float32 and
        kept: the library reads them by address)."""
        if len(weights) != N_WEIGHTS:
            raise SwiftkError(f"MoA kernel: {len(weights)} weight tensors, the kernel takes {N_WEIGHTS}")
        D, m, a = hidden, mlp, lsa_dim
        sizes = (d * D, d, 3 * d * d, d * d, d, d * d, 2 * d, d * d, d, 2 * m * d, d * m, d, D * d,
                 d // heads // 2, 2 * d * a)   # cpu_moa.cpp's order: the kernel reads exactly these
        bad = [i for i, (w, n) in enumerate(zip(weights, sizes)) if w.numel() != n]
        if bad:
            raise SwiftkError(f"MoA kernel: weight {bad[0]} has {weights[bad[0]].numel()} values, the dims say "
                              f"{sizes[bad[0]]}")
        self.lib = native.library()
        if self.lib is None:
            raise SwiftkError("MoA kernel: the CPU kernel library is not loaded")
        self.weights = [w.detach().to(torch.float32, copy=True).contiguous() for w in weights]
        self.ptrs = (ctypes.c_void_p * N_WEIGHTS)(*[w.data_ptr() for w in self.weights])
        self.dims = (ctypes.c_int64 * 5)(hidden, d, heads, mlp, lsa_dim)
        self.d, self.hidden, self.lsa_dim = d, hidden, lsa_dim

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise SwiftkError(f"MoA {what}: the kernel returned {rc} "
                              f"({'out of memory' if rc == -2 else 'bad arguments'})")

    def step(self, emb: torch.Tensor, p: int, n: int, sa_k: torch.Tensor, sa_v: torch.Tensor,
             ca_k: torch.Tensor, ca_v: torch.Tensor, anchor: Optional[torch.Tensor]) -> torch.Tensor:
        """One step for the token with embedding ``emb`` [1, hidden] at position ``p``, ``n`` verified positions:
        writes row ``p`` of ``sa_k``/``sa_v`` [S, heads, hd] (contiguous float32, like ``ca_k``/``ca_v``) and
        returns the predicted activation [1, hidden]."""
        _state((sa_k, sa_v, ca_k, ca_v), max(p + 1, n), self.d)
        e = _vector(emb, self.hidden, "emb")
        a = None if anchor is None else _vector(anchor, self.d, "anchor")
        out = torch.empty(1, self.hidden, dtype=torch.float32)
        self._check(self.lib.swk_moa_step(self.ptrs, self.dims, e.data_ptr(), p, n, sa_k.data_ptr(), sa_v.data_ptr(),
                                          ca_k.data_ptr(), ca_v.data_ptr(), None if a is None else a.data_ptr(),
                                          out.data_ptr()), "step")
        return out

    def ingest(self, feats: torch.Tensor, emb: torch.Tensor, p0: int, ca_k: torch.Tensor, ca_v: torch.Tensor,
               sa_k: torch.Tensor, sa_v: torch.Tensor) -> None:
        """Positions p0 .. p0 + t - 1 with LSA features ``feats`` [t, lsa_dim] and embeddings ``emb`` [t, hidden]:
        writes their rows of the cross-attention (``ca_k``/``ca_v``) and self-attention (``sa_k``/``sa_v``) state."""
        t = feats.shape[0] if feats.dim() == 2 else -1
        if t < 0 or p0 < 0:
            raise SwiftkError(f"MoA ingest: features must be [t, {self.lsa_dim}], got {tuple(feats.shape)} at {p0}")
        _state((ca_k, ca_v, sa_k, sa_v), p0 + t, self.d)
        f = _vector(feats, t * self.lsa_dim, "feats")
        e = _vector(emb, t * self.hidden, "emb")
        self._check(self.lib.swk_moa_ingest(self.ptrs, self.dims, f.data_ptr(), e.data_ptr(), p0, t, ca_k.data_ptr(),
                                            ca_v.data_ptr(), sa_k.data_ptr(), sa_v.data_ptr()), "ingest")
