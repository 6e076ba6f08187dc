"""What identifies a CPU kernel build: the sources it was compiled from and the CPU it was compiled for. Standard
library only, so setup.py loads this file by path at install time (no torch there) and writes the manifest that
native.py checks with the same two functions."""
import hashlib
import os
import platform
from pathlib import Path


def sources_digest(folder) -> str:
    """sha256 over the kernel sources in ``folder`` (kernels/cpu's .cpp and .h files, by name)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith((".cpp", ".h")):
            h.update(name.encode() + b"\0" + (Path(folder) / name).read_bytes() + b"\0")
    return h.hexdigest()


def cpu_id() -> str:
    """Model name + feature flags of this CPU (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(keep)
    except OSError:
        return platform.processor() or platform.machine()
