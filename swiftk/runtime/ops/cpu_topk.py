"""The CPU backend of top-k over score rows (``kernels/cpu/cpu_topk.cpp``, from the one kernel library): the
sampler's argmax, Token Recycling's candidate table. Its torch twin is ``torch.topk`` (``argmax`` for k = 1), which
serves where the kernel does not apply or the library is not loaded."""
from __future__ import annotations

import ctypes

import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.ops import native


def _takes(x: torch.Tensor, k: int) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and 1 <= k <= min(64, x.shape[1])
            and x.shape[0] >= 1 and native.active())


def topk_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """[M, k] int64: the indices of each row's k largest values of x [M, V], in torch.topk's order (equal values
    by lower index, NaN first), so k = 1 is torch.argmax."""
    if x.dim() == 1:
        return topk_rows(x[None], k)[0]
    if not _takes(x, k):
        return x.argmax(dim=-1, keepdim=True) if k == 1 else x.topk(k, dim=-1).indices
    xc = x.contiguous()
    out = torch.empty(x.shape[0], k, dtype=torch.int64)
    if native.library().swk_topk_rows(xc.data_ptr(), xc.shape[0], xc.shape[1], k, out.data_ptr()) != 0:
        raise SwiftkError(f"cpu topk: kernel rejected x {tuple(x.shape)}, k={k}")
    return out


def topk_into(x: torch.Tensor, rows: list, table: torch.Tensor, table_rows: list) -> None:
    """``table[table_rows[m]] = topk_rows(x[rows[m]], k)`` for each m in order, k = table's width (int32 table
    [T, k]), without copying the rows out of x: one C call where the library is loaded, else torch."""
    k = table.shape[1]
    if len(rows) != len(table_rows) or any(not 0 <= r < x.shape[0] for r in rows) \
            or any(not 0 <= r < table.shape[0] for r in table_rows):
        raise SwiftkError(f"topk_into: rows {rows} of x {tuple(x.shape)} or table rows {table_rows} of "
                          f"{tuple(table.shape)} out of range")
    if rows and x.is_contiguous() and table.dtype == torch.int32 and table.is_contiguous() and _takes(x, k):
        r = (ctypes.c_int64 * len(rows))(*rows)
        t = (ctypes.c_int64 * len(table_rows))(*table_rows)
        if native.library().swk_topk_into(x.data_ptr(), x.shape[0], x.shape[1], r, len(rows), k, table.data_ptr(),
                                          table.shape[0], t) != 0:
            raise SwiftkError(f"cpu topk: kernel rejected rows {rows} of x {tuple(x.shape)} or table rows "
                              f"{table_rows} of {tuple(table.shape)}")
        return
    if rows:
        table[torch.tensor(table_rows, dtype=torch.long)] = topk_rows(x[rows].float(), k).to(torch.int32).cpu()
