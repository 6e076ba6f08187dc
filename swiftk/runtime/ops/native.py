"""The CPU kernel library: one shared library from the translation units of ``kernels/cpu/`` (:data:`SOURCES`),
checked and loaded once per process. The op modules (cpu_linear: the float matmul, the layer loop, top-k,
acceptance's walk, n-grams; cpu_quant: the GGUF block matmuls) bind their functions from it; nothing else opens a
library. One library, so one thread pool (kernels/cpu/cpu_pool.h): every parallel region of every kernel runs on
the same workers whatever thread calls in.

Where it comes from, in order:
1. **Installed**: ``pip install`` compiles it (setup.py, kernels/cpu/CMakeLists.txt) into ``swiftk/_native/``,
   for the ISA variants of kernels/cpu/variants.json it was asked for (default: the installing machine's own,
   ``native``). The best variant this CPU can run is loaded, if its bytes match the install's manifest and it was
   built from the sources beside it (an edited checkout falls through to 2).
2. **Compiled at first use**, once per machine: ``g++ -O3 -march=native`` (``$CXX`` if set; GCC with ``--param=max-combine-insns=2``, as the install), the translation units
   in parallel, into ``$SWIFTK_KERNEL_CACHE`` (default ``~/.cache/swiftk-kernels``) under a name that hashes the
   sources, flags, compiler and CPU; a line says so, and how long it took. Written under a temporary name, then
   renamed, with a sidecar of its size and sha256 checked before every load.
``SWIFTK_CPU_KERNELS=0`` turns the library off (torch runs every op), ``=build`` skips 1.

Without a compiler or AVX2+FMA, or when the build fails, the runtime uses torch; :func:`status` says why.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from swiftk.atomic import write_json_atomic
from swiftk.errors import SwiftkError, warn
from swiftk.files import read_bytes, read_json
from swiftk.runtime.ops import cpu_abi, kernel_id
from swiftk.runtime.ops.kernel_id import cpu_id as _cpu_id   # a name tests replace

MAX_LIBRARY_BYTES = 64 << 20   # the built library is ~1 MB
ENV_VAR = "SWIFTK_CPU_KERNELS"
CACHE_VAR = "SWIFTK_KERNEL_CACHE"
FLAGS = ["-O3", "-march=native", "-pthread", "-fPIC", "-std=c++17", "-pipe"]
# the translation units (setup.py / CMakeLists.txt build the same), then the files they include (part of the key)
SOURCES = ("cpu_decode.cpp", "cpu_linear.cpp", "cpu_topk.cpp", "cpu_ngram.cpp", "cpu_kv.cpp", "cpu_quant.cpp", "cpu_qdot.cpp",
           "cpu_qdot_q4.cpp", "cpu_qdot_q58.cpp", "cpu_qdot_q4k.cpp", "cpu_qdot_q5k.cpp", "cpu_qdot_q6k.cpp",
           "cpu_pool.cpp", "cpu_moa.cpp")
INCLUDES = ("cpu_gguf.h", "cpu_simd.h", "cpu_pool.h", "cpu_qdot.h")
STEM = "swiftk_cpu"
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


def source_path(name: str) -> Path:
    here = Path(__file__).resolve()
    for cand in (here.parents[2] / "kernels" / "cpu" / name,    # installed: swiftk/kernels/cpu/
                 here.parents[3] / "kernels" / "cpu" / name):   # source checkout: ./kernels/cpu/
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"kernels/cpu/{name} not found next to the swiftk package")


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CXX") or "g++")


def _sidecar(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256.json")


def _digest(path: Path) -> dict:
    data = read_bytes(path, "kernel library", MAX_LIBRARY_BYTES)
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _verify(lib: Path) -> Optional[str]:
    """None when ``lib`` is the file swiftk built (size and hash as its sidecar says); else why not. Checked before
    every dlopen: a truncated or replaced library would crash dlopen or the first call (SIGBUS/SIGSEGV)."""
    try:
        have = _digest(lib)
        want = read_json(_sidecar(lib), "kernel library sidecar", object, 1 << 16)
    except (OSError, ValueError, SwiftkError) as e:
        return f"{type(e).__name__}: {e}"
    if not isinstance(want, dict) or want != have:
        return f"size/sha256 {have['size']}/{have['sha256'][:12]} differ from its sidecar's"
    return None


try:   # resolved here: a forked child should call nothing that takes a lock
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent() -> None:
    """In a child before it runs: SIGTERM when the thread that started it dies (PR_SET_PDEATHSIG), so a SIGTERM or
    SIGKILL to swiftk never leaves a compiler finishing a library nobody waits for."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)


# The compiler driver forks cc1plus and as, which a signal to the driver alone leaves running: a shell leads their
# process group and, told by its death signal, kills the whole group; an interrupt kills the group directly.
_GROUP = 'trap "kill -9 0" TERM; "$@" & wait $!'


def _compile(cmd: list) -> subprocess.Popen:
    return subprocess.Popen(["/bin/sh", "-c", _GROUP, "sh", *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_die_with_parent)


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:   # already gone
        pass


_TEMP = re.compile(r"^\.(?:swiftk_cpu|cpu_linear|cpu_quant)-[0-9a-f]+\.(\d+)\.\d+\.(?:so|\d+\.o)$")


def sweep(out_dir: Path) -> None:
    """Remove half-built libraries (temp names carry their writer's pid) whose writer is no longer running."""
    try:
        names = os.listdir(out_dir)
    except OSError:
        return
    for name in names:
        m = _TEMP.match(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue   # its writer is alive (another process building now)
        except ProcessLookupError:
            pass
        except OSError:   # another user's process: alive
            continue
        try:
            os.unlink(out_dir / name)
        except OSError:
            pass


def kernel_cache() -> Path:
    """Where first-use builds go: one per machine, whatever $SWIFTK_HOME a process uses."""
    return Path(os.environ.get(CACHE_VAR) or Path.home() / ".cache" / "swiftk-kernels")


def link(cxx: str, flags: list, sources: list, out: Path, objs: Optional[list] = None) -> None:
    """Compile ``sources`` in parallel (one compiler per core) and link them into the shared library ``out``;
    RuntimeError with the compiler's message on failure. ``objs``: where the object files go (the caller removes
    them), default beside ``out``."""
    objs = objs or [out.with_name(f"{out.name}.{i}.o") for i in range(len(sources))]

    running, stop, lock = [], threading.Event(), threading.Lock()

    def compile_one(i: int):
        with lock:
            if stop.is_set():
                return None
            p = _compile([cxx, *flags, "-c", "-o", str(objs[i]), str(sources[i])])
            running.append(p)
        _, err = p.communicate(timeout=900)
        return p.returncode, err

    ex = ThreadPoolExecutor(max(1, os.cpu_count() or 1))
    try:
        for res in ex.map(compile_one, range(len(sources))):
            if res is not None and res[0] != 0:
                raise RuntimeError(f"{cxx} failed: {res[1].strip()[-600:]}")
    except BaseException:   # a failure or an interrupt: no compiler runs on after it
        with lock:
            stop.set()
            for p in running:
                _kill_group(p)
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    p = _compile([cxx, *flags, "-shared", "-o", str(out), *map(str, objs)])
    try:
        _, err = p.communicate(timeout=300)
    except BaseException:
        _kill_group(p)
        raise
    if p.returncode != 0:
        raise RuntimeError(f"{cxx} failed: {err.strip()[-600:]}")


def build(cxx: str, flags=FLAGS, out_dir: Optional[Path] = None) -> Path:
    """The library built with ``flags`` into ``out_dir`` (default :func:`kernel_cache`), or the one already there;
    returns its path. The translation units compile in parallel, one compiler per core."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    if "Free Software Foundation" in version:   # GCC: as kernels/cpu/CMakeLists.txt (half the compile time)
        flags = [*flags, "--param=max-combine-insns=2"]
    texts = [source_path(n).read_text() for n in (*SOURCES, *INCLUDES)]
    key = hashlib.sha256("\0".join([*texts, " ".join(flags), version, _cpu_id()]).encode()).hexdigest()[:16]
    out_dir = Path(out_dir) if out_dir is not None else kernel_cache()
    out = out_dir / f"{STEM}-{key}.so"
    sweep(out_dir)
    if out.exists() or _sidecar(out).exists():
        why = _verify(out)
        if why is None:
            return out
        warn(f"swiftk: rebuilding the CPU kernel library {out}: {why}", RuntimeWarning)
        out.unlink(missing_ok=True)
        _sidecar(out).unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{STEM}-{key}.{os.getpid()}.{threading.get_ident()}.so"
    objs = [out_dir / f".{STEM}-{key}.{os.getpid()}.{threading.get_ident()}.{i}.o" for i in range(len(SOURCES))]
    print(f"swiftk: compiling the CPU kernels for this machine (once; ~30 s on 2 cores) into {out_dir} ...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        link(cxx, flags, [source_path(n) for n in SOURCES], tmp, objs)
        # sidecar first: a library without its sidecar (or with another's) is never loaded
        write_json_atomic(_sidecar(out), _digest(tmp))
        os.replace(tmp, out)
    finally:
        for f in (tmp, *objs):
            f.unlink(missing_ok=True)
    print(f"swiftk: CPU kernels compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    why = _verify(out)   # another process may have replaced either file meanwhile
    if why is not None:
        raise RuntimeError(f"{out}: {why}")
    return out


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
            if _digest(path) != {"size": entry.get("size"), "sha256": entry.get("sha256")}:
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
    cxx = _compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler (g++ or $CXX) found")
    try:
        path = build(cxx)
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
