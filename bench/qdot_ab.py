"""The int8-activation kernel (kernels/cpu/cpu_qdot.cpp) of two git revisions side by side, in one process: each
revision's source built with the project's flags into a temporary folder, then a model's matrices (random blocks of
its shapes and formats, enough copies to stream from memory as a pass does) multiplied at each pass size M on one
thread, the two builds interleaved call by call so machine noise hits both alike. Prints the median time per M of the
layers and of the head, and old / new. ``--old-opt`` / ``--new-opt`` replace -O3 (e.g. the same revision at -O2).

    python -m bench.qdot_ab --old HEAD~1 --new WORKTREE --rows 1,4,5,8,12,16

Shapes: SmolLM2-135M (30 layers of Q4_1 qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536; head Q8_0
49152x576) unless --shapes names others as ``TYPE:KxN,...`` (one layer, repeated --layers times).
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "Q4_1:576x960,Q4_1:576x576,Q4_1:576x3072,Q4_1:1536x576"
SMOLLM2_HEAD = "Q8_0:576x49152"
# CMakeLists.txt's flags under GCC (the scheduling pair is the K-format units' there; here every unit's: neutral
# on the 32-element formats)
FLAGS = ["-O3", "-march=native", "-pthread", "-fPIC", "-std=c++17", "-pipe", "--param=max-combine-insns=2",
         "-fsched-pressure", "-fschedule-insns"]


def _build(rev: str, out: Path, opt: str = "-O3") -> ctypes.CDLL:
    """The int8-activation kernels of git revision ``rev`` ("WORKTREE": the files on disk): cpu_qdot*.cpp (one file
    before the K formats got units of their own), the pool and every header, built with FLAGS (by hand, not CMake: old revisions predate it)."""
    src = out / rev.replace("/", "_").replace("~", "_")
    src.mkdir(parents=True)
    if rev == "WORKTREE":
        names = sorted(p.name for p in (ROOT / "kernels" / "cpu").iterdir())
    else:
        names = sorted(Path(n).name for n in subprocess.run(
            ["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "kernels/cpu/"], capture_output=True, text=True,
            check=True).stdout.split())
    names = [n for n in names if n.endswith(".h") or n.startswith("cpu_qdot") and n.endswith(".cpp")
             or n == "cpu_pool.cpp"]   # revisions before the pool: OpenMP
    for name in names:
        path = f"kernels/cpu/{name}"
        text = (ROOT / path).read_text() if rev == "WORKTREE" else subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
        (src / name).write_text(text)
    units = [src / n for n in names if n.endswith(".cpp")]
    so = src / "qdot.so"
    cxx = shutil.which("g++") or "c++"
    omp = ["-fopenmp"] if "omp.h" in (src / "cpu_qdot.cpp").read_text() else []
    # opt in place of -O3, after -march=native (an -march in it wins); it may hold several flags (-O2 -DSWI_...)
    flags = [f for f in FLAGS if f != "-O3"] + opt.split() + ["-shared"]
    subprocess.run([cxx, *flags, *omp, "-I", str(ROOT / "csrc" / "include"), "-o", str(so), *map(str, units)],
                   check=True)
    lib = ctypes.CDLL(str(so))
    lib.swk_qi_linear_ld.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    return lib


def _mats(spec: str, layers: int, rng) -> list:
    from bench.quant_linear import _random_blocks
    from swiftk.runtime.ops import cpu_quant

    out = []
    for _ in range(layers):
        for item in spec.split(","):
            name, kn = item.split(":")
            K, N = (int(v) for v in kn.split("x"))
            t = cpu_quant.TYPES[name]
            out.append((int(t), K, N, cpu_quant.repack(_random_blocks(name, N, K, rng), t, K)))
    return out


def _run(lib, M: int, mats: list, xs: dict, y: torch.Tensor) -> float:
    f = lib.swk_qi_linear_ld
    t = time.perf_counter()
    for ty, K, N, pk in mats:
        f(xs[K][:M].data_ptr(), M, K, pk.data_ptr(), ty, N, y.data_ptr(), N)
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.qdot_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="HEAD~1", help="git revision (or WORKTREE)")
    ap.add_argument("--new", default="WORKTREE", help="git revision (or WORKTREE)")
    ap.add_argument("--rows", default="1,4,5,8,12,16")
    ap.add_argument("--shapes", default=SMOLLM2)
    ap.add_argument("--head", default=SMOLLM2_HEAD)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=13, help="odd: the median is a run")
    ap.add_argument("--old-opt", default="-O3")
    ap.add_argument("--new-opt", default="-O3")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"old": _build(a.old, Path(tmp), a.old_opt), "new": _build(a.new, Path(tmp) / "n", a.new_opt)}
        parts = {"layers": _mats(a.shapes, a.layers, rng), "head": _mats(a.head, 1, rng)}
        Ms = [int(m) for m in a.rows.split(",")]
        Ks = {K for p in parts.values() for _, K, _, _ in p}
        xs = {K: torch.randn(max(Ms), K) for K in Ks}
        y = torch.empty(max(Ms), max(N for p in parts.values() for _, _, N, _ in p))
        # one thread: each library's pool starts with one (two pools spinning on the same cores would skew both)
        print(f"# old = {a.old} {a.old_opt}, new = {a.new} {a.new_opt}; 1 thread; median of {a.reps}, interleaved")
        print("| M | layers old ms | new ms | old / new | head old ms | new ms | old / new |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for M in Ms:
            runs = {(v, p): [] for v in libs for p in parts}
            for r in range(a.reps):
                for v in (("old", "new") if r % 2 else ("new", "old")):
                    for p, mats in parts.items():
                        runs[(v, p)].append(_run(libs[v], M, mats, xs, y))
            best = {k: sorted(t)[len(t) // 2] for k, t in runs.items()}
            row = [f"{best[(v, p)] * 1e3:.2f}" if v == "old" else f"{best[(v, p)] * 1e3:.2f} | "
                   f"{best[('old', p)] / best[('new', p)]:.2f}x" for p in parts for v in ("old", "new")]
            print(f"| {M} | " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
