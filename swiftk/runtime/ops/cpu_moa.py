"""The MoA drafter's step in the kernel library (kernels/cpu/cpu_moa.cpp), a thin binding: the drafter (swiftk/moa,
a plugin) hands over its tensors once and calls one step per draft token. Its torch twin is
swiftk/moa/runner.py ``MoARunner.step``."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.ops import native

N_WEIGHTS = 14   # cpu_moa.cpp's weight list: tok_in .. out, then inv_freq


class MoAStep:
    def __init__(self, weights: list, hidden: int, d: int, heads: int, mlp: int):
        """``weights``: the drafter's N_WEIGHTS tensors in cpu_moa.cpp's order (copied to contiguous float32 and
        kept: the library reads them by address)."""
        if len(weights) != N_WEIGHTS:
            raise SwiftkError(f"MoA step: {len(weights)} weight tensors, the kernel takes {N_WEIGHTS}")
        self.lib = native.library()
        if self.lib is None:
            raise SwiftkError("MoA step: the CPU kernel library is not loaded")
        self.weights = [w.detach().to(torch.float32, copy=True).contiguous() for w in weights]
        self.ptrs = (ctypes.c_void_p * N_WEIGHTS)(*[w.data_ptr() for w in self.weights])
        self.dims = (ctypes.c_int64 * 4)(hidden, d, heads, mlp)
        self.d, self.hidden = d, hidden

    def __call__(self, emb: torch.Tensor, p: int, n: int, sa_k: torch.Tensor, sa_v: torch.Tensor,
                 ca_k: torch.Tensor, ca_v: torch.Tensor, anchor: Optional[torch.Tensor]) -> torch.Tensor:
        """One step for the token with embedding ``emb`` [1, hidden] at position ``p``, ``n`` verified positions:
        writes row ``p`` of ``sa_k``/``sa_v`` [S, heads, hd] (contiguous float32, like ``ca_k``/``ca_v``) and
        returns the predicted activation [1, hidden]."""
        for t in (sa_k, sa_v, ca_k, ca_v):
            if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() or \
                    t.shape[0] <= max(p, n - 1) or t[0].numel() != self.d:
                raise SwiftkError(f"MoA step: state tensors must be contiguous float32 CPU tensors "
                                  f"[> {max(p, n - 1)}, {self.d}]")
        for t, size, what in ((emb, self.hidden, "emb"), (anchor, self.d, "anchor")):
            if t is not None and (t.device.type != "cpu" or t.numel() != size):
                raise SwiftkError(f"MoA step: {what} must be a CPU tensor of {size} values, got {tuple(t.shape)} "
                                  f"on {t.device}")
        e = emb.to(torch.float32).contiguous()
        a = None if anchor is None else anchor.to(torch.float32).contiguous()
        out = torch.empty(1, self.hidden, dtype=torch.float32)
        rc = self.lib.swk_moa_step(self.ptrs, self.dims, e.data_ptr(), p, n, sa_k.data_ptr(), sa_v.data_ptr(),
                                   ca_k.data_ptr(), ca_v.data_ptr(), None if a is None else a.data_ptr(),
                                   out.data_ptr())
        if rc:
            raise SwiftkError(f"MoA step: the kernel returned {rc} ({'out of memory' if rc == -2 else 'bad arguments'})")
        return out
