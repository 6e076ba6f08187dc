"""Weight formats and the matmul every projection runs: float tensors, bfloat16 or int8 (QWeight) matrices read
by the CPU kernel (ops/cpu_linear.py) with float32 activations, torch elsewhere."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import SwiftkError
from . import hugepages
from .ops import cpu_layers, cpu_linear, cpu_quant, native
from .ops.cpu_quant import ACTIVATIONS, INT8_ACT, TYPES


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


@dataclass(frozen=True)
class BlockWeight:
    """A matrix as a GGUF file stores it: ggml blocks (Q4_0 ... Q6_K), one row of blocks per output row, read by
    the block kernel (kernels/cpu/cpu_quant.cpp) without ever being widened to float32 in memory.

    ``parts``: row groups ((raw [n_i, K / block * block_bytes] uint8, ggml type id), ...) stacked in order: a fused
    matrix keeps each source tensor's format (Q4_K_M files store some layers' v or down in Q6_K). ``act``: the
    activation arithmetic its matmuls run, "float32" (the de-quantized model) or "int8" (ops/cpu_quant.py), whose
    kernel reads the blocks packed (cpu_quant.repack: the file's bytes permuted, the same size): ``packed``."""
    parts: tuple
    K: int
    act: str = "float32"

    def __post_init__(self):
        if self.act not in ACTIVATIONS:
            raise SwiftkError(f"BlockWeight act={self.act!r}: use one of {', '.join(ACTIVATIONS)}")
        flag = INT8_ACT if self.act == "int8" else 0
        # what kernels/cpu/cpu_decode.cpp reads for weight type 3: n_parts, then (address, type, rows) per part
        desc = [len(self.parts)] + [v for raw, t in self.parts for v in (raw.data_ptr(), int(t) | flag, raw.shape[0])]
        object.__setattr__(self, "descriptor", torch.tensor(desc, dtype=torch.int64))

    @property
    def packed(self) -> bool:
        return self.act == "int8"

    def with_act(self, act: str) -> "BlockWeight":
        """The same matrix multiplied with ``act`` activations (packed or unpacked: a copy of the blocks)."""
        if act == self.act:
            return self
        if self.packed:
            parts = tuple((cpu_quant.unpack_rows(raw, t, self.K, torch.arange(raw.shape[0])), t)
                          for raw, t in self.parts)
        else:
            parts = tuple((cpu_quant.repack(raw, t, self.K), t) for raw, t in self.parts)
        return BlockWeight(parts, self.K, act)

    @property
    def shape(self):
        return torch.Size((sum(raw.shape[0] for raw, _ in self.parts), self.K))

    @property
    def device(self):
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(raw.numel() for raw, _ in self.parts)

    def numel(self) -> int:
        return self.shape[0] * self.K

    @property
    def types(self) -> list:
        return [int(t) for _, t in self.parts]

    @staticmethod
    def cat(ws) -> "BlockWeight":
        """Row-stack block weights of one K and one act; adjacent groups of one format become one group (one
        kernel call): a view when they lie back to back in one buffer (the loader reads them so), else a copy.
        Packed groups join only behind a group of whole 8-row groups (its rows past the last 8 are unpacked)."""
        if len({w.act for w in ws}) != 1:
            raise SwiftkError("BlockWeight.cat: the matrices' activations differ")
        parts: list = []
        for w in ws:
            for raw, t in w.parts:
                if parts and parts[-1][1] == t and not (w.packed and parts[-1][0].shape[0] % 8):
                    prev = parts[-1][0]
                    if (prev.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
                            and prev.data_ptr() + prev.numel() == raw.data_ptr()):
                        both = prev.new_empty(0).set_(prev.untyped_storage(), prev.storage_offset(),
                                                      (prev.shape[0] + raw.shape[0], prev.shape[1]))
                    else:
                        both = torch.cat([prev, raw])
                    parts[-1] = (both, t)
                else:
                    parts.append((raw, t))
        return BlockWeight(tuple(parts), ws[0].K, ws[0].act)

    def __getitem__(self, idx) -> "BlockWeight":
        """The rows ``idx`` (a 1-D index tensor), as one group in the file's layout (float32 activations): a draft
        head's subset of the LM head."""
        if len(self.parts) != 1:
            raise SwiftkError("row subsets of a block weight in several formats are not supported")
        return BlockWeight(((self._raw_rows(0, idx), self.parts[0][1]),), self.K)

    def _raw_rows(self, i: int, ids) -> torch.Tensor:
        """Rows ``ids`` of part ``i`` in the file's layout."""
        raw, t = self.parts[i]
        if self.packed:
            return cpu_quant.unpack_rows(raw, t, self.K, torch.as_tensor(ids))
        return raw[ids].contiguous()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), K]: rows ``ids`` dequantized (an embedding lookup)."""
        flat = ids.reshape(-1).cpu()
        if len(self.parts) == 1 and flat.numel():   # one format (every embedding we load): no selection
            t = self.parts[0][1]
            got = self._raw_rows(0, flat)
            return cpu_quant.dequant(t, got.reshape(-1), got.shape[0] * self.K).reshape(*ids.shape, self.K)
        out = torch.empty(flat.numel(), self.K, dtype=torch.float32)
        start = 0
        for i, (raw, t) in enumerate(self.parts):
            sel = (flat >= start) & (flat < start + raw.shape[0])
            if sel.any():
                got = self._raw_rows(i, flat[sel] - start)
                out[sel] = cpu_quant.dequant(t, got.reshape(-1), got.shape[0] * self.K).reshape(-1, self.K)
            start += raw.shape[0]
        return out.reshape(*ids.shape, self.K)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0]))


def dense(t) -> torch.Tensor:
    """Any weight as a float tensor (training and tools that want plain matrices)."""
    return t.dequantize() if isinstance(t, (QWeight, BlockWeight)) else t


def nbytes(t) -> int:
    """Bytes a read of the whole weight costs (a QWeight counts its scales)."""
    return t.nbytes if isinstance(t, (QWeight, BlockWeight)) else t.numel() * t.element_size()


# "native": the GGUF file's own block formats (loaders.py keeps them; float32 activations)
WEIGHT_FORMATS = ("bfloat16", "int8", "native")


# CPU linears run on swiftk's own kernel (kernels/cpu/cpu_linear.cpp, built at first use; see swiftk/runtime/ops/cpu_linear.py):
# it reads each weight once for all T rows and is batch invariant. Without it (no compiler, SWIFTK_CPU_KERNELS=0)
# torch's matmul serves, in the product form measured faster for T rows on this CPU: MKL's x @ w.T at a few rows
# is 1.6-3x slower than its one-row GEMV on some CPUs and the faster form on others (choose_cpu_linear_forms).
_TRANSPOSED: dict = {}
# Every pass that can be a verify pass (trees of <= 64 nodes, config.max_tree_nodes) runs on the batch-invariant
# kernels (and on CPU through the fused C loop), so a verify pass equals the plain steps bit for bit; longer
# passes are prefills, which both arms share: on CPU the fused loop runs them as passes of this many tokens, else
# they take GEMM.
KERNEL_MAX_ROWS = 64


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] times w [N, K] transposed -> [T, N] in x's dtype (w may be a QWeight, or bfloat16 under float32
    activations: the weight formats of ``Model(weights=...)``)."""
    if x.device.type != "cpu":
        return x @ w.T
    T = x.shape[0]
    if T == 0:   # no rows asked for (e.g. logits_idx empty): the kernel takes none
        return x.new_empty(0, w.shape[0])
    if isinstance(w, BlockWeight):   # the block kernel amortises each block over all T rows; prefills take GEMM
        return cpu_quant.linear_parts(x, w.parts, w.K, w.act)
    if T <= KERNEL_MAX_ROWS and native.active():
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
    """(addresses [n_layers, width] int64, weight types [n_layers, 4] int32): what kernels/cpu/cpu_decode.cpp reads
    per layer (norms, matrices and their scales, bias, the layer's KV cache)."""

    def w(t):
        if isinstance(t, BlockWeight):
            return t.descriptor, None
        return (t.q, t.scale) if isinstance(t, QWeight) else (t, None)

    def wtype(t):
        if isinstance(t, BlockWeight):
            return 3
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
    if table.shape[1] != cpu_layers.layer_table_width():
        raise SwiftkError("kernels/cpu/cpu_decode.cpp's layer table does not match swiftk/runtime/weights.py")
    return table, torch.tensor(types, dtype=torch.int32)


def named_weights(model):
    """(GGUF-style name, weight) for every weight a Model holds; layers share one name per kind."""
    yield "token_embd", model.embed
    yield "output_norm", model.norm
    if model.lm_head is not model.embed:
        yield "output", model.lm_head
    for L in model.layers:
        yield from (("blk.*.attn_norm", L.attn_norm), ("blk.*.attn_qkv", L.wqkv), ("blk.*.attn_output", L.wo),
                    ("blk.*.ffn_norm", L.mlp_norm), ("blk.*.ffn_gate_up", L.w_gate_up), ("blk.*.ffn_down", L.w_down))
        if L.bqkv is not None:
            yield "blk.*.attn_qkv_bias", L.bqkv


def weight_pages(model) -> dict:
    """How the weights' memory is paged: the system's transparent huge page mode and the bytes of the block
    weights' buffers held in 2 MiB pages (hugepages.py: a decode step streams them all)."""
    seen, huge = set(), 0
    for _, t in named_weights(model):
        for raw in ([r for r, _ in t.parts] if isinstance(t, BlockWeight) else []):
            st = raw.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                huge += min(st.nbytes(), hugepages.huge_bytes(st.data_ptr(), st.nbytes()))   # smaps: whole mappings
    return {"transparent_huge_pages": hugepages.status(), "huge_page_bytes": huge}


def formats(model) -> dict:
    """Storage format of each kind of weight: GGUF block type names, INT8, or the float dtype (F32, BF16, F16)."""
    names = {v: k for k, v in TYPES.items()}
    floats = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    out: dict = {}
    for name, t in named_weights(model):
        if isinstance(t, BlockWeight):
            fs = {names[x] for x in t.types}
        else:
            fs = {"INT8" if isinstance(t, QWeight) else floats.get(t.dtype, str(t.dtype))}
        out[name] = sorted(set(out.get(name, [])) | fs)
    if model.lm_head is model.embed:
        out["output"] = out["token_embd"]
    return out
