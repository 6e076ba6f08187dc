"""Weight memory in 2 MiB pages. A decode step streams every weight once: with 4 KiB pages a 1 GB model crosses
~250k pages per step, each a TLB miss and (in a VM) a nested page walk, and the hardware prefetchers stop at every
page boundary. In 2 MiB pages the registry models decoded 1.05-1.25x faster on a 2-core KVM guest
(bench/results/history.md).

Linux backs a region with transparent huge pages when it is advised (``madvise(MADV_HUGEPAGE)``) before its first
touch and ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (Ubuntu's and Debian's default) or
``always``; with ``never``, or on another OS, the buffer is an ordinary one. :func:`status` says which. The cost is
at load: on a KVM guest whose host backs freed memory lazily, first touching 1 GB in 2 MiB pages took ~1.6-2 s more
than in 4 KiB pages (the guest's page clearing faulted on the host); ``SWIFTK_HUGE_PAGES=0`` turns it off.
"""
from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import torch

from ..errors import SwiftkError

HUGE = 2 << 20
_SYSFS = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ENV_VAR = "SWIFTK_HUGE_PAGES"   # 0: plain pages (a load ~1.5 s faster per GB on a VM that backs huge pages lazily)
ENABLED = True   # benches compare both arms in one process through this; SWIFTK_HUGE_PAGES sets it per process


def _enabled() -> bool:
    v = os.environ.get(ENV_VAR, "1").strip()
    if v not in ("0", "1"):
        raise SwiftkError(f"{ENV_VAR}={v!r}: use 1 (weights in 2 MiB pages, the default) or 0 (plain pages)")
    return ENABLED and v == "1"


def empty(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 buffer of ``nbytes`` for weights, starting on a 2 MiB boundary and advised for huge
    pages (Linux, buffers of at least 2 MiB, unless turned off); else a plain ``torch.empty``."""
    if not _enabled() or nbytes < HUGE or not sys.platform.startswith("linux"):
        return torch.empty(nbytes, dtype=torch.uint8)
    # a private mapping of its own, never touched: malloc may hand back heap memory already paged in 4 KiB, and a
    # shared anonymous mapping (mmap's default) is shmem, which THP's madvise mode leaves alone
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mm, dtype=torch.uint8)   # keeps mm alive: unmapped with the last view
    off = (-base.data_ptr()) % HUGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, off, (nbytes + HUGE - off) // 4096 * 4096)
    except OSError:   # advice only (a kernel without THP): the buffer works either way
        pass
    return base[off:off + nbytes]


def status() -> str:
    """The system's transparent huge page mode, as /sys says it (``madvise``, ``always``, ``never``), or why not."""
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform}): 4 KiB pages"
    try:
        text = _SYSFS.read_text()
    except OSError:
        return "no transparent huge pages in this kernel"
    mode = text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()
    return mode if _enabled() else f"{mode} (off: {ENV_VAR}=0)" if ENABLED else f"{mode} (off in this process)"


def huge_bytes(ptr: int, nbytes: int) -> int:
    """Bytes of [ptr, ptr + nbytes) this process holds in transparent huge pages, from /proc/self/smaps (the
    mappings that overlap the range, whole); 0 where the file is missing."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    total, inside = 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):   # a mapping's first line: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < ptr + nbytes and ptr < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
