"""The CPU kernel library's first-use build: kernels/cpu/CMakeLists.txt, run by CMake, as ``pip install`` runs it
(setup.py). The unit list, the ISA flags (kernels/cpu/variants.json) and the compiler's options live there only.

:func:`build` makes one library per machine in the kernel cache (``$SWIFTK_KERNEL_CACHE``, default
``~/.cache/swiftk-kernels``), named by a hash of the sources, the build files, the compiler and the CPU: configured
and built in a private tree beside it, checked into place under a sidecar of its size and sha256
(:func:`verify` before every load), and never left half-written: an interrupt kills the whole build, and a tree
whose writer died is swept by the next build.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from swiftk.atomic import write_json_atomic
from swiftk.errors import SwiftkError, warn
from swiftk.files import read_bytes, read_json
from swiftk.runtime.ops import kernel_id

MAX_LIBRARY_BYTES = 64 << 20   # the built library is ~1 MB
CACHE_VAR = "SWIFTK_KERNEL_CACHE"
STEM = "swiftk_cpu"
# a writer's private tree or file in the cache: .<name>.<pid>.<thread>.(build|so) (and older builds' .<i>.o)
_TEMP = re.compile(r"^\.(?:swiftk_cpu|cpu_linear|cpu_quant)-[0-9a-f]+\.(\d+)\.\d+\.(?:so|build|\d+\.o)$")


def source_path(name: str) -> Path:
    here = Path(__file__).resolve()
    for cand in (here.parents[2] / "kernels" / "cpu" / name,    # installed: swiftk/kernels/cpu/
                 here.parents[3] / "kernels" / "cpu" / name):   # source checkout: ./kernels/cpu/
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"kernels/cpu/{name} not found next to the swiftk package")


def compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CXX") or "g++")


def cmake() -> Optional[str]:
    """CMake from the path, else the ``cmake`` package's (``pip install cmake``)."""
    found = shutil.which("cmake")
    if found is None:
        try:
            import cmake as pkg   # optional: only where no system cmake is on the path
            found = shutil.which("cmake", path=pkg.CMAKE_BIN_DIR)
        except ImportError:
            pass
    return found


# ---- the files: a library is loaded only as the bytes its sidecar (or the install's manifest) names
def sidecar(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256.json")


def digest(path: Path) -> dict:
    data = read_bytes(path, "kernel library", MAX_LIBRARY_BYTES)
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def verify(lib: Path) -> Optional[str]:
    """None when ``lib`` is the file swiftk built (size and hash as its sidecar says); else why not. Checked before
    every dlopen: a truncated or replaced library would crash dlopen or the first call (SIGBUS/SIGSEGV)."""
    try:
        have = digest(lib)
        want = read_json(sidecar(lib), "kernel library sidecar", object, 1 << 16)
    except (OSError, ValueError, SwiftkError) as e:
        return f"{type(e).__name__}: {e}"
    if not isinstance(want, dict) or want != have:
        return f"size/sha256 {have['size']}/{have['sha256'][:12]} differ from its sidecar's"
    return None


def kernel_cache() -> Path:
    """Where first-use builds go: one per machine, whatever $SWIFTK_HOME a process uses."""
    return Path(os.environ.get(CACHE_VAR) or Path.home() / ".cache" / "swiftk-kernels")


def sweep(out_dir: Path) -> None:
    """Remove half-built libraries and build trees (their names carry their writer's pid) whose writer is no longer
    running."""
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
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


# ---- running CMake so that nothing outlives an interrupt
try:   # resolved here: a forked child should call nothing that takes a lock
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent() -> None:
    """In a child before it runs: SIGTERM when the thread that started it dies (PR_SET_PDEATHSIG), so a SIGTERM or
    SIGKILL to swiftk never leaves a compiler finishing a library nobody waits for."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)


# CMake runs make, which runs the compiler driver, which forks cc1plus and as: a signal to the first alone leaves
# the rest running. A shell leads their process group and, told by its death signal, kills the whole group.
_GROUP = 'trap "kill -9 0" TERM; "$@" & wait $!'


def _run(cmd: list, timeout: float) -> None:
    """``cmd`` in its own process group; RuntimeError with the end of its output when it fails. An interrupt or a
    timeout kills the group."""
    p = subprocess.Popen(["/bin/sh", "-c", _GROUP, "sh", *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True, preexec_fn=_die_with_parent)
    try:
        out, _ = p.communicate(timeout=timeout)
    except BaseException:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:   # already gone
            pass
        raise
    if p.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed: {_gist(out)}")


# make's and CMake's own lines around a failed compile: what is left is the compiler's (or CMake's) message
_NOISE = re.compile(r"^\s*(--|g?make(\[\d+\])?:|\[\s*\d+%\]|Run Build|Change Dir|Call Stack|Building |Linking |"
                    r"Scanning |Consolidate |CMake Error at .*/Modules/|The CXX compiler|is not able to compile|"
                    r"It fails with|CMake will not be able|Configuring incomplete|See also|/\S+\s+-)")


def _gist(out: str) -> str:
    """The compiler's diagnostics (lines with "error:"), else what of the output is not make's or CMake's own."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    keep = [ln for ln in lines if "error:" in ln.lower()] or [ln for ln in lines if not _NOISE.match(ln)] or lines
    return " | ".join(keep)[-600:]


def build_library(out: Path, cxx: str, variant: str = "native", opt: Optional[str] = None,
                  units: Optional[list] = None, tree: Optional[Path] = None) -> None:
    """kernels/cpu/CMakeLists.txt built with CMake into a private tree beside ``out``, its library moved to ``out``;
    the tree removed. ``variant``: of kernels/cpu/variants.json; ``opt``: the optimization flags (``-O3``; an
    ``-march`` there wins over the variant's); ``units``: a subset of the translation units (tests of one kernel);
    ``tree``: the build tree (default beside ``out``)."""
    tool = cmake()
    if tool is None:
        raise RuntimeError("no cmake found (the kernels build with kernels/cpu/CMakeLists.txt; pip install cmake)")
    tree = tree or out.with_name(f".{out.stem}.{os.getpid()}.{threading.get_ident()}.build")
    args = [f"-DSWIFTK_CPU_VARIANTS={variant}", f"-DCMAKE_CXX_COMPILER={cxx}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={tree / 'lib'}", "-DCMAKE_BUILD_TYPE=Release"]
    if opt is not None:
        args.append(f"-DSWIFTK_CPU_OPT={opt}")
    if units is not None:
        args.append(f"-DSWIFTK_CPU_UNITS={';'.join(units)}")
    try:
        _run([tool, "-S", str(source_path("CMakeLists.txt").parent), "-B", str(tree), *args], 300)
        _run([tool, "--build", str(tree), "-j", str(max(1, os.cpu_count() or 1))], 1800)
        os.replace(tree / "lib" / f"{STEM}-{variant}.so", out)
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def build(cxx: str, out_dir: Optional[Path] = None) -> Path:
    """The library for this machine (``native``) in ``out_dir`` (default :func:`kernel_cache`), built now or
    already there; returns its path."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    folder = source_path("CMakeLists.txt").parent
    build_files = [(folder / n).read_text() for n in ("CMakeLists.txt", "variants.json")]
    env = [os.environ.get(v, "") for v in ("CXXFLAGS", "LDFLAGS")]   # CMake's first configure reads them
    key = hashlib.sha256("\0".join([kernel_id.sources_digest(folder), *build_files, *env, version,
                                    kernel_id.cpu_id()]).encode()).hexdigest()[:16]
    out_dir = Path(out_dir) if out_dir is not None else kernel_cache()
    out = out_dir / f"{STEM}-{key}.so"
    sweep(out_dir)
    if out.exists() or sidecar(out).exists():
        why = verify(out)
        if why is None:
            return out
        warn(f"swiftk: rebuilding the CPU kernel library {out}: {why}", RuntimeWarning)
        out.unlink(missing_ok=True)
        sidecar(out).unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    mine = f".{STEM}-{key}.{os.getpid()}.{threading.get_ident()}"
    tmp = out_dir / f"{mine}.so"
    print(f"swiftk: compiling the CPU kernels for this machine (once; ~30 s on 2 cores) into {out_dir} ...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        build_library(tmp, cxx, tree=out_dir / f"{mine}.build")
        # sidecar first: a library without its sidecar (or with another's) is never loaded
        write_json_atomic(sidecar(out), digest(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"swiftk: CPU kernels compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    why = verify(out)   # another process may have replaced either file meanwhile
    if why is not None:
        raise RuntimeError(f"{out}: {why}")
    return out
