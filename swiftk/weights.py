"""Weight formats and the matmul every projection runs: float tensors, bfloat16 or int8 (QWeight) matrices read
by the CPU kernel (ops/cpu_linear.py) with float32 activations, torch elsewhere."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SwiftkError
from .ops import cpu_linear


@dataclass(frozen=True)
class QWeight:
    """A weight-only int8 matrix: w ~= q * scale[:, None] (symmetric, one float32 scale per output row).

    Rows can be gathered (``w[ids]``) like a tensor's; :func:`linear` runs it on the CPU kernel."""
    q: torch.Tensor       # [N, K] int8
    scale: torch.Tensor   # [N] float32

    @staticmethod
    def quantize(w: torch.Tensor) -> "QWeight":
        wf = w.float()
        scale = (wf.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return QWeight(q.contiguous(), scale.contiguous())

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    @property
    def shape(self):
        return self.q.shape

    @property
    def device(self):
        return self.q.device

    def __getitem__(self, idx) -> "QWeight":
        return QWeight(self.q[idx], self.scale[idx])

    def numel(self) -> int:
        return self.q.numel()

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()


def nbytes(t) -> int:
    """Bytes a read of the whole weight costs (a QWeight counts its scales)."""
    return t.nbytes if isinstance(t, QWeight) else t.numel() * t.element_size()


WEIGHT_FORMATS = ("bfloat16", "int8")


# CPU linears run on swiftk's own kernel (kernels/cpu_linear.cpp, built at first use; see swiftk/ops/cpu_linear.py):
# it reads each weight once for all T rows and is batch invariant. Without it (no compiler, SWIFTK_CPU_KERNELS=0)
# torch's matmul serves, in the product form measured faster for T rows on this CPU: MKL's x @ w.T at a few rows
# is 1.6-3x slower than its one-row GEMV on some CPUs and the faster form on others (choose_cpu_linear_forms).
_TRANSPOSED: dict = {}
KERNEL_MAX_ROWS = 32   # above this many rows (a prefill) MKL's GEMM beats the skinny kernel


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] times w [N, K] transposed -> [T, N] in x's dtype (w may be a QWeight, or bfloat16 under float32
    activations: the weight formats of ``Model(weights=...)``)."""
    if x.device.type != "cpu":
        return x @ w.T
    T = x.shape[0]
    if T == 0:   # no rows asked for (e.g. logits_idx empty): the kernel takes none
        return x.new_empty(0, w.shape[0])
    if T <= KERNEL_MAX_ROWS and cpu_linear.active():
        return cpu_linear.fast(x, w.q, w.scale) if isinstance(w, QWeight) else cpu_linear.fast(x, w)
    # Prefill-sized passes (MKL's GEMM is compute-efficient there), or no kernel: torch, on float weights.
    if isinstance(w, QWeight):
        w = w.dequantize().to(x.dtype)
    elif w.dtype != x.dtype:
        w = w.to(x.dtype)
    if T > 1 and _TRANSPOSED.get(min(T, 8), True):
        return (w @ x.T).T
    return x @ w.T


def choose_cpu_linear_forms(w: torch.Tensor, repeats: int = 5) -> dict:
    """Time both torch product forms on ``w`` (a large weight of the model) for 2, 3, 4, 6 and 8 rows; remember the
    faster per row count (counts in between use the next measured one)."""
    import time

    def best(f):
        t = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            t = min(t, time.perf_counter() - t0)
        return t

    out = {}
    for T in (2, 3, 4, 6, 8):
        x = torch.randn(T, w.shape[1], dtype=w.dtype)
        (w @ x.T).T, x @ w.T  # warm-up
        out[T] = best(lambda: (w @ x.T).T) < best(lambda: x @ w.T)
    for T in (5, 7):
        out[T] = out[T + 1]
    _TRANSPOSED.update(out)
    return out


def fused_layer_table(layers, cache) -> tuple:
    """(addresses [n_layers, width] int64, weight types [n_layers, 4] int32): what kernels/cpu_decode.cpp reads
    per layer (norms, matrices and their scales, bias, the layer's KV cache)."""

    def w(t):
        return (t.q, t.scale) if isinstance(t, QWeight) else (t, None)

    def wtype(t):
        return 2 if isinstance(t, QWeight) else 1 if t.dtype == torch.bfloat16 else 0

    rows, types = [], []
    for li, L in enumerate(layers):
        row = [L.attn_norm.data_ptr()]
        for t in (L.wqkv,):
            q, s = w(t)
            row += [q.data_ptr(), 0 if s is None else s.data_ptr()]
        row.append(0 if L.bqkv is None else L.bqkv.data_ptr())
        q, s = w(L.wo)
        row += [q.data_ptr(), 0 if s is None else s.data_ptr(), L.mlp_norm.data_ptr()]
        for t in (L.w_gate_up, L.w_down):
            q, s = w(t)
            row += [q.data_ptr(), 0 if s is None else s.data_ptr()]
        row.append(cache.data[li].data_ptr())
        rows.append(row)
        types.append([wtype(t) for t in (L.wqkv, L.wo, L.w_gate_up, L.w_down)])
    table = torch.tensor(rows, dtype=torch.int64)
    if table.shape[1] != cpu_linear.layer_table_width():
        raise SwiftkError("kernels/cpu_decode.cpp's layer table does not match swiftk/weights.py")
    return table, torch.tensor(types, dtype=torch.int32)
