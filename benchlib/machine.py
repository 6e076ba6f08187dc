"""The machine a run measures on: threads, the CPU named from /proc/cpuinfo (family/model to microarchitecture),
the device kind, the record every result file carries, and the memory-bandwidth probes printed beside speeds."""
from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from swiftk.errors import SwiftkError


def set_threads(n) -> int:
    n = int(n) if n else (os.cpu_count() or 1)
    if n < 1:
        raise SwiftkError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return n


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# (vendor, family) -> [(first model, last model, name)], from the vendors' published family/model numbers
_ARCH = {
    ("AuthenticAMD", 23): [(0x00, 0x0F, "Zen"), (0x10, 0x2F, "Zen+"), (0x30, 0xFF, "Zen 2")],
    ("AuthenticAMD", 25): [(0x00, 0x0F, "Zen 3"), (0x10, 0x1F, "Zen 4"), (0x20, 0x5F, "Zen 3"), (0x60, 0xAF, "Zen 4")],
    ("AuthenticAMD", 26): [(0x00, 0xFF, "Zen 5")],
    ("GenuineIntel", 6): [(0x55, 0x55, "Skylake-SP / Cascade Lake"), (0x6A, 0x6C, "Ice Lake-SP"),
                          (0x8F, 0x8F, "Sapphire Rapids"), (0xCF, 0xCF, "Emerald Rapids"), (0xAD, 0xAE, "Granite Rapids")],
}


def cpu_arch() -> str:
    """The CPU's microarchitecture from /proc/cpuinfo's vendor, family and model (e.g. family 25 model 1: Zen 3),
    with the numbers, so a result names its machine rather than guessing it."""
    try:
        info = dict(ln.split(":", 1) for ln in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                    if ":" in ln)
        info = {k.strip(): v.strip() for k, v in info.items()}
        vendor, fam, mod = info["vendor_id"], int(info["cpu family"]), int(info["model"])
    except (OSError, KeyError, ValueError):
        return "unknown"
    name = next((n for lo, hi, n in _ARCH.get((vendor, fam), []) if lo <= mod <= hi), "unlisted")
    flags = set(info.get("flags", "").split())
    if name == "unlisted" and "amx_int8" in flags:   # a hypervisor's generic model number on an AMX server core
        name = "unlisted model number, AMX: Sapphire Rapids or later"
    isa = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX-512" if "avx512f" in flags else \
        "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({vendor} family {fam} model {mod}, {isa})"


def device_kind(device) -> str:
    """Short tag for file names: 'cpu' or 'cuda-<gpu model>'."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(dev).lower().replace("nvidia", "").strip()
    return "cuda-" + "".join(c if c.isalnum() else "-" for c in name).strip("-")


def machine_info(device, threads: int) -> dict:
    import transformers

    dev = torch.device(device)
    info = {"cpu": cpu_model(), "cpu_arch": cpu_arch(), "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model()}
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                            cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        info["git_commit"] = None
    return info


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def copy_bandwidth(device, mib: int = 0, repeats: int = 5) -> float:
    """Device memory bandwidth in bytes/s from a big tensor copy (bytes read + written / best time)."""
    dev = torch.device(device)
    mib = mib or (1024 if dev.type == "cuda" else 256)
    n = mib * 1024 * 1024 // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / best


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Host memory read speed in GB/s (a float32 sum over ``mib`` MiB, best of ``repeats``): a decode step streams
    the weights, so this is its ceiling. Benches record it at their start and end, because a VM's memory speed
    moves between runs (bench/results/history.md) and ratios move with it. The buffer is in 2 MiB pages where the
    system allows, as swiftk's weights are (runtime/hugepages.py): in 4 KiB pages the same sum read ~20% less."""
    from swiftk.runtime import hugepages

    x = hugepages.empty(mib * 1024 * 1024).view(torch.float32).fill_(1.0)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9
