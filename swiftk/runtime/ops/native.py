"""The CPU kernel library: one shared library built from ``kernels/cpu/`` by its CMakeLists.txt, checked and loaded
once per process. The op modules (cpu_linear: the float matmul, the layer loop, top-k, acceptance's walk, n-grams;
cpu_quant: the GGUF block matmuls) bind their functions from it (typed in cpu_abi.py); nothing else opens a
library. One library, so one thread pool (kernels/cpu/cpu_pool.h): every parallel region of every kernel runs on
the same workers whatever thread calls in.

Where it comes from, in order:
1. **Installed**: ``pip install`` builds it (setup.py runs kernels/cpu/CMakeLists.txt) into ``swiftk/_native/``,
   for the ISA variants of kernels/cpu/variants.json it was asked for (default: the installing machine's own,
   ``native``). The best variant this CPU can run is loaded, if its bytes match the install's manifest and it was
   built from the sources beside it (an edited checkout falls through to 2).
2. **Built at first use**, once per machine, by the same CMakeLists.txt (native_build.py): into
   ``$SWIFTK_KERNEL_CACHE`` (default ``~/.cache/swiftk-kernels``); a line says so, and how long it took.
``SWIFTK_CPU_KERNELS=0`` turns the library off (torch runs every op), ``=build`` skips 1.

Without a compiler, CMake or AVX2+FMA, or when the build fails, the runtime uses torch; :func:`status` says why.
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
import threading
from pathlib import Path
from typing import Optional

import torch

from swiftk.errors import SwiftkError, warn
from swiftk.files import read_json
from swiftk.runtime.ops import cpu_abi, kernel_id, native_build
from swiftk.runtime.ops.kernel_id import cpu_id as _cpu_id   # a name tests replace
from swiftk.runtime.ops.native_build import digest, source_path

ENV_VAR = "SWIFTK_CPU_KERNELS"
INSTALLED = Path(__file__).resolve().parents[2] / "_native"   # swiftk/_native/

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_why: Optional[str] = None   # why there is no library, once decided ("" when there is one)
_threads = 0                 # the thread count last given to the library's pool
_source = ""                 # which library was loaded, for status lines
_enabled = True              # set_enabled(False): torch serves the float ops


class KernelUnavailable(Exception):
    """Why the kernel library is not used; ``loud``: a toolchain failure worth a warning (not a setting)."""

    def __init__(self, why: str, loud: bool = False):
        super().__init__(why)
        self.loud = loud


def _variants() -> dict:
    return json.loads(source_path("variants.json").read_text())


def sources_digest() -> str:
    """sha256 over kernels/cpu's .cpp and .h files, as setup.py records it in the install's manifest."""
    return kernel_id.sources_digest(source_path("cpu_pool.h").parent)


def installed() -> tuple:
    """(path, variant) of the installed library this CPU should load, or (None, why none)."""
    try:
        manifest = read_json(INSTALLED / "manifest.json", "kernel manifest", object, 1 << 20)
    except (OSError, SwiftkError) as e:
        return None, f"no installed library ({e})"
    if not isinstance(manifest, dict) or manifest.get("sources") != sources_digest():
        return None, "the installed library was built from other sources (an edited checkout)"
    variants = manifest.get("variants") or {}
    if not isinstance(variants, dict) or not all(isinstance(e, dict) for e in variants.values()):
        warn(f"swiftk: the kernel manifest {INSTALLED / 'manifest.json'} is malformed ('variants' must map each "
             "variant to an object); compiling a library for this machine instead", RuntimeWarning)
        return None, "malformed manifest"
    have, table = set(_cpu_id().split()), _variants()
    for v in table["order"]:
        entry = variants.get(v)
        if not entry:
            continue
        if v == "native" and manifest.get("cpu") != _cpu_id():
            continue   # -march=native of another machine
        if not set(table["variants"][v]["cpu"]) <= have:
            continue
        path = INSTALLED / str(entry.get("file"))
        try:
            if digest(path) != {"size": entry.get("size"), "sha256": entry.get("sha256")}:
                warn(f"swiftk: the installed CPU kernel library {path} is damaged (size/sha256 differ from its "
                     "manifest); compiling one for this machine instead", RuntimeWarning)
                return None, "damaged"
        except (OSError, SwiftkError):
            continue
        return path, v
    return None, "no installed variant runs on this CPU"


def _open() -> ctypes.CDLL:
    global _source
    if os.environ.get(ENV_VAR, "").strip() == "0":
        raise KernelUnavailable(f"disabled by {ENV_VAR}=0")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelUnavailable(f"needs x86-64 (AVX2+FMA or AVX-512), this is {platform.machine()}")
    if os.environ.get(ENV_VAR, "").strip() != "build":
        path, variant = installed()
        if path is not None:
            _source = f"installed ({variant}): {path}"
            return ctypes.CDLL(str(path))
    cxx = native_build.compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler (g++ or $CXX) found")
    if native_build.cmake() is None:   # loud: a machine with a compiler expects the kernels
        raise KernelUnavailable("no cmake found to build them (kernels/cpu/CMakeLists.txt; pip install cmake)",
                                loud=True)
    try:
        path = native_build.build(cxx)
        _source = f"compiled for this machine: {path}"
        return ctypes.CDLL(str(path))
    except Exception as e:  # noqa: BLE001 - any toolchain problem means: use torch
        raise KernelUnavailable(f"build failed ({type(e).__name__}: {str(e)[:300]})", loud=True) from e


def library() -> Optional[ctypes.CDLL]:
    """The loaded library (built on first call), or None; :func:`status` then says why."""
    global _lib, _why
    if _why is None:
        with _lock:
            if _why is None:
                try:
                    lib = _open()
                except KernelUnavailable as e:
                    _why = str(e)
                    if e.loud:
                        warn(f"swiftk: CPU kernels unavailable, using torch: {_why}", RuntimeWarning)
                    return None
                missing = cpu_abi.bind(lib)
                if missing:
                    _why = f"the kernel library lacks {', '.join(missing)} ({_source})"
                    warn(f"swiftk: CPU kernels unavailable, using torch: {_why}", RuntimeWarning)
                    return None
                _lib, _why = lib, ""
                sync_threads()
    return _lib


def set_enabled(on: bool) -> None:
    """Switch the library's float ops (matmul, layer loop, top-k, acceptance walk, n-gram walk) off or on for this
    process: off, torch serves them (benchmarks' A/B, tests). The block-quant matmuls have no torch path and stay."""
    global _enabled
    _enabled = bool(on)


def active() -> bool:
    """The float ops' check per call: switched on and the library loaded (built on first call)."""
    return _enabled and (_lib is not None if _why is not None else library() is not None)


def loaded() -> Optional[ctypes.CDLL]:
    """The library where it is already loaded and switched on, else None: never a build (a decode call uses it)."""
    return _lib if _enabled else None


def why() -> str:
    """Why there is no library ("" when there is one; builds it on first call)."""
    library()
    return _why or ""


def sync_threads() -> None:
    """Give the kernels' pool torch's thread count where it changed (regions that are not given one use it)."""
    global _threads
    n = torch.get_num_threads()
    if n != _threads and _lib is not None:
        _lib.swk_set_threads(n)
        _threads = n


def source() -> str:
    """Which library this process loaded: installed (its variant) or compiled for this machine, and its path."""
    library()
    return _source


def pool_workers() -> int:
    """Worker threads the kernels' pool has started (regions from any host thread share them)."""
    lib = library()
    return int(lib.swk_pool_workers()) if lib is not None else 0


def reset() -> None:
    """Forget the load decision (tests: after changing SWIFTK_CPU_KERNELS or $CXX). A library already loaded stays
    mapped; the next :func:`library` call decides again."""
    global _lib, _why, _threads, _source
    with _lock:
        _lib, _why, _threads, _source = None, None, 0, ""
