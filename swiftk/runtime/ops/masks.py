"""The attention masks the kernels read: the packed tree bitmask (:class:`TreeMask`, built by decoding/tree.py)
and the bounded dense mask of the CUDA-graph passes (:class:`BoundedMask`)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


def pack_tree_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    """Dense ancestor mask [T, T] bool -> packed bits [T, ceil(T/32)] int32 (bit j%32 of word j//32).

    The format the tree-attention kernels read."""
    T = tree_mask.shape[0]
    W = (T + 31) // 32
    padded = torch.zeros(T, W * 32, dtype=torch.int64, device=tree_mask.device)
    padded[:, :T] = tree_mask.to(torch.int64)
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=tree_mask.device),
                                       torch.arange(32, device=tree_mask.device))
    words = (padded.view(T, W, 32) * weights).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret the low 32 bits as signed int32
    return words.to(torch.int32)


def unpack_tree_mask(bits: torch.Tensor, T: int) -> torch.Tensor:
    """Inverse of :func:`pack_tree_mask`: [T, W] int32 -> [T, T] bool."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int64)
    b = (bits.to(torch.int64)[:, :, None] >> shifts) & 1
    return b.reshape(bits.shape[0], -1)[:, :T].bool()


class BoundedMask(NamedTuple):
    """A dense ``[T, S]`` bool mask whose columns from ``limit`` (a one-element int tensor on the device) on are all
    False: kernels stop reading keys there, so a CUDA graph built for the whole cache serves every length."""

    mask: torch.Tensor
    limit: torch.Tensor


class TreeMask(NamedTuple):
    """Committed slots [0, prefix_len) fully visible; new token i sees new token j iff bit j of row i is set.

    ``ancestors`` is the same relation unpacked ([T, T] bool) when the builder has it, so the torch attention
    path never unpacks the bits again. ``bits`` may be None where ``ancestors`` is given: the CPU layer loop reads
    the unpacked relation, so a CPU tree packs its bits only if a kernel asks (:meth:`packed`)."""

    prefix_len: int
    bits: Optional[torch.Tensor]
    ancestors: Optional[torch.Tensor] = None

    def packed(self) -> torch.Tensor:
        """The bits [T, ceil(T/32)] int32 the tree-attention kernels read."""
        return self.bits if self.bits is not None else pack_tree_mask(self.ancestors)

    @staticmethod
    def causal(prefix_len: int, T: int, device) -> "TreeMask":
        tri = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        return TreeMask(prefix_len, pack_tree_mask(tri), tri)

    @staticmethod
    def of(prefix_len: int, ancestors: torch.Tensor) -> "TreeMask":
        return TreeMask(prefix_len, pack_tree_mask(ancestors), ancestors)

    def dense(self, rows: Optional[slice] = None) -> torch.Tensor:
        """[T', prefix_len + T] bool over cache slots (all prefix slots + the tree relation)."""
        anc = self.ancestors if self.ancestors is not None else unpack_tree_mask(self.bits, self.bits.shape[0])
        if rows is not None:
            anc = anc[rows]
        return torch.cat([torch.ones(anc.shape[0], self.prefix_len, dtype=torch.bool, device=anc.device), anc], 1)
