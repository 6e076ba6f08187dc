"""The GGUF block-quant CPU kernels: matmul with weights kept in ggml block formats.

``linear(x, w_raw, type, K, act)`` computes ``x @ W.T`` where ``W`` is ``w_raw``'s rows of ggml blocks (a GGUF
tensor's bytes, one row of blocks per output row). ``act="float32"`` (``kernels/cpu/cpu_quant.cpp``): blocks
dequantized in registers, float32 activations, the exact de-quantized model. ``act="int8"``
(``kernels/cpu/cpu_qdot.cpp``): each activation row quantized to int8 in blocks of 32 elements (float32 scale),
integer dot products, as llama.cpp computes. Both are batch
invariant. ``dequant(type, raw, n)`` is the plain dequantization, equal bit for bit to ``gguf.quants.dequantize``.
Types: ggml ids in :data:`TYPES`.

Bound from the one kernel library (ops/native.py builds and loads it); :func:`status` says which path the build
took or why there is none.
"""
from __future__ import annotations


import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.ops import native

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
_NAMES = {v: k for k, v in TYPES.items()}
ACTIVATIONS = ("int8", "float32")   # the activation arithmetic of a block matmul (act=...)
INT8_ACT = 256                      # SWK_Q_INT8_ACT: a type code with this bit runs kernels/cpu/cpu_qdot.cpp
_ERRORS = {-1: "null pointer or non-positive size", -2: "unknown type", -3: "size not a multiple of the block size"}

def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call)."""
    return native.library() is not None


def status() -> str:
    """One line: the path the build took (AVX-512, AVX2 or portable C++), or why there is no kernel."""
    lib = native.library()
    if lib is not None:
        isa = {512: "AVX-512", 256: "AVX2"}.get(lib.swk_q_isa(), "portable C++")
        return f"swiftk quant kernels (kernels/cpu/cpu_quant.cpp {isa}; int8 activations kernels/cpu/cpu_qdot.cpp {int_isa()})"
    return f"unavailable ({native.why()})"


def int_isa() -> str:
    """The path of the int8-activation kernel in this build: "AVX-512 VNNI", "AVX2+VNNI", "AVX2" or "portable C++"."""
    return {3: "AVX-512 VNNI", 2: "AVX2+VNNI", 1: "AVX2"}.get(int(_need().swk_qi_isa()), "portable C++")


def pairs_rows() -> bool:
    """True when this build's int8-activation kernel multiplies a pass's activation rows two at a time (AVX-512
    VNNI, every pass of 2 rows or more): a pass of an odd T >= 3 then costs about what T + 1 costs."""
    return int(_need().swk_qi_isa()) == 3


def isa() -> int:
    """512, 256 or 0 (portable): the vector path of the loaded build."""
    return int(_need().swk_q_isa())


def _need():
    """The library, or SwiftkError naming why there is none."""
    lib = native.library()
    if lib is None:
        raise SwiftkError(f"CPU quant kernel unavailable: {native.why()}")
    return lib


def _sizes(qtype) -> tuple:
    """(elements, bytes) per block of ggml type ``qtype`` (an int or a GGMLQuantizationType)."""
    lib = _need()
    t = int(qtype)
    bs, ts = lib.swk_q_block_size(t), lib.swk_q_type_size(t)
    if bs < 0:
        raise SwiftkError(f"cpu quant: unsupported ggml type {qtype!r}; supported: "
                          + ", ".join(f"{k}={v}" for k, v in TYPES.items()))
    return bs, ts


def block_size(qtype) -> int:
    return _sizes(qtype)[0]


def type_size(qtype) -> int:
    return _sizes(qtype)[1]


def _raw(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous():
        what = f"{t.dtype} {t.device} contiguous={t.is_contiguous()}" if isinstance(t, torch.Tensor) else type(t)
        raise SwiftkError(f"cpu quant: {name} must be a contiguous CPU uint8 tensor, got {what}")


def dequant(qtype, raw: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` elements (whole blocks) of type ``qtype`` in ``raw`` (uint8, exactly n / block_size blocks) as a
    float32 tensor [n], bit for bit gguf.quants.dequantize's."""
    bs, ts = _sizes(qtype)
    _raw("raw", raw)
    n = int(n)
    if n < 1 or n % bs:
        raise SwiftkError(f"cpu quant: n={n} is not a positive multiple of {_NAMES[int(qtype)]}'s block size {bs}")
    if raw.numel() != n // bs * ts:
        raise SwiftkError(f"cpu quant: {n} elements of {_NAMES[int(qtype)]} take {n // bs * ts} bytes, "
                          f"raw has {raw.numel()}")
    out = torch.empty(n, dtype=torch.float32)
    _check(native.library().swk_q_dequant(int(qtype), raw.data_ptr(), n, out.data_ptr()), "dequant")
    return out


def _act_code(qtype, act: str) -> int:
    if act not in ACTIVATIONS:
        raise SwiftkError(f"cpu quant: act={act!r}: use one of {', '.join(ACTIVATIONS)}")
    return int(qtype) | (INT8_ACT if act == "int8" else 0)


def linear(x: torch.Tensor, w_raw: torch.Tensor, qtype, K: int, act: str = "float32", *, packed: bool = False,
           reference: bool = False) -> torch.Tensor:
    """y [M, N] float32 = x [M, K] @ W.T, W = ``w_raw`` [N, K / block_size * type_size] uint8: N rows of ggml
    blocks of type ``qtype``. x in any float dtype (computed in float32); ``act``: the activation arithmetic
    (module docstring). The int8 kernel reads W packed (:func:`repack`): ``packed=True`` says ``w_raw`` is, else it
    is packed for this call (a weight used more than once: pack it once). ``reference``: the int8 path's scalar
    definition on the file's layout (tests). Raises SwiftkError on bad operands."""
    code = _act_code(qtype, act)
    if packed and (act != "int8" or reference):
        raise SwiftkError("cpu quant: packed=True is the int8 kernel's layout (act='int8', not the reference)")
    bs, ts = _sizes(qtype)
    _raw("w_raw", w_raw)
    K = int(K)
    name = _NAMES[int(qtype)]
    if K < 1 or K % bs:
        raise SwiftkError(f"cpu quant: K={K} is not a positive multiple of {name}'s block size {bs}")
    if w_raw.dim() != 2 or w_raw.shape[0] < 1 or w_raw.shape[1] != K // bs * ts:
        raise SwiftkError(f"cpu quant: a {name} weight with K={K} needs shape [N, {K // bs * ts}] (bytes per row), "
                          f"got {tuple(w_raw.shape)}")
    if (not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != K or x.shape[0] < 1
            or x.device.type != "cpu" or not x.dtype.is_floating_point):
        what = f"{tuple(x.shape)} {x.dtype} {x.device}" if isinstance(x, torch.Tensor) else type(x)
        raise SwiftkError(f"cpu quant: x must be a float CPU tensor [M, {K}], got {what}")
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    M, N = xf.shape[0], w_raw.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    lib = native.library()
    fn = lib.swk_qi_linear_ref if reference else lib.swk_q_linear_ld
    if reference and act != "int8":
        raise SwiftkError("cpu quant: reference=True is the int8-activation path's definition (act='int8')")
    if act == "int8" and not reference and not packed:
        w_raw = repack(w_raw, qtype, K)
    _check(fn(xf.data_ptr(), M, K, w_raw.data_ptr(), int(qtype) if reference else code, N, y.data_ptr(), N),
           "linear")
    return y


def repack(raw: torch.Tensor, qtype, K: int) -> torch.Tensor:
    """``raw`` [N, bytes per row] (ggml blocks of ``qtype`` in the file's layout) packed for the int8 kernel: rows
    in groups of 8 with each block's fields side by side (kernels/cpu/cpu_qdot.cpp). Same shape and size."""
    bs, ts = _sizes(qtype)
    _raw("raw", raw)
    if raw.dim() != 2 or raw.shape[0] < 1 or K % bs or raw.shape[1] != K // bs * ts:
        raise SwiftkError(f"cpu quant: repack needs [N, {K // bs * ts}] bytes of {_NAMES[int(qtype)]} rows, "
                          f"got {tuple(raw.shape)}")
    out = torch.empty_like(raw)
    _check(native.library().swk_qi_repack(int(qtype), raw.data_ptr(), raw.shape[0], int(K), out.data_ptr()), "repack")
    return out


def unpack_rows(packed: torch.Tensor, qtype, K: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a :func:`repack`-ed matrix in the file's layout: [len(ids), bytes per row] uint8."""
    bs, ts = _sizes(qtype)
    _raw("packed", packed)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), packed.shape[1], dtype=torch.uint8)
    if flat.numel():
        _check(native.library().swk_qi_unpack_rows(int(qtype), packed.data_ptr(), packed.shape[0], int(K), flat.data_ptr(),
                                       flat.numel(), out.data_ptr()), "unpack_rows")
    return out


def quantize(x: torch.Tensor, simd: bool = True) -> tuple:
    """(q [M, K] int8, d [M, K / 32] float32): the int8 path's activation quantizer on x [M, K] float32 (blocks of
    32); ``simd=False`` runs its scalar definition (tests hold the two equal)."""
    lib = _need()
    if (not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] % 32
            or x.shape[0] < 1):
        raise SwiftkError("cpu quant: quantize needs float32 [M, K] with K a multiple of 32")
    xc = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.int8)
    d = torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.float32)
    _check(lib.swk_qi_quantize(xc.data_ptr(), x.shape[0], x.shape[1], int(simd), q.data_ptr(), d.data_ptr()),
           "quantize")
    return q, d


PANEL_MIN_ROWS = 128   # passes this long (prefills: verify passes stop at 65 rows) take _panels_into
_PANEL = 256           # weight rows de-quantized per GEMM call (~1.5-9 MB of float32 at K = 1536-8960)


def linear_parts(x: torch.Tensor, parts, K: int, act: str = "float32") -> torch.Tensor:
    """y [M, sum N_i] float32 = x [M, K] @ [W_1; W_2; ...].T for ``parts`` ((raw_i [N_i, bytes per row] uint8,
    qtype_i), ...): a matrix whose row groups are stored in different formats (a GGUF file's q, k and v), each
    group writing its column slice of one output: by the block kernel of ``act``, or with float32 activations for
    passes of >= ``PANEL_MIN_ROWS`` rows by :func:`_panels_into`. int8: the parts are packed (:func:`repack`). The
    caller has checked the parts (BlockWeight)."""
    lib = _need()
    native.sync_threads()
    int8 = act == "int8"
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    M = xf.shape[0]
    N = sum(raw.shape[0] for raw, _ in parts)
    y = torch.empty(M, N, dtype=torch.float32)
    col, base = 0, y.data_ptr()
    for raw, qtype in parts:
        if M >= PANEL_MIN_ROWS and not int8:
            _panels_into(xf, raw, qtype, int(K), y[:, col:col + raw.shape[0]])
        else:
            _check(lib.swk_q_linear_ld(xf.data_ptr(), M, int(K), raw.data_ptr(), int(qtype) | (INT8_ACT * int8),
                                        raw.shape[0], base + 4 * col, N), "linear")
        col += raw.shape[0]
    return y


def _panels_into(xf: torch.Tensor, raw: torch.Tensor, qtype, K: int, out: torch.Tensor) -> None:
    """out [M, n] = xf @ W.T with ``_PANEL`` rows of W at a time de-quantized to float32 for torch's GEMM, which
    runs the float32 FMAs faster than the block kernel's register tiles once each block would be decoded again for
    every 4 activation rows. Same weights, float32 accumulation in another order: prefill rows need not match
    decode steps bit for bit (speculation compares verify passes, <= 65 rows, with steps)."""
    for r0 in range(0, raw.shape[0], _PANEL):
        rows = raw[r0:r0 + _PANEL]
        wf = dequant(qtype, rows, rows.shape[0] * K).view(rows.shape[0], K)
        out[:, r0:r0 + rows.shape[0]].copy_(xf @ wf.T)


def _check(rc: int, what: str) -> None:
    if rc == -4:   # not an argument's fault
        raise SwiftkError(f"cpu quant {what}: out of memory for the kernel's buffers")
    if rc != 0:
        raise SwiftkError(f"cpu quant {what}: kernel rejected its arguments ({_ERRORS.get(rc, rc)})")
