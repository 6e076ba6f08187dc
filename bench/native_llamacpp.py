"""Native llama.cpp, built once for the benches: the llama.cpp source tree that the llama-cpp-python sdist vendors,
compiled with its own CMake (``-DGGML_NATIVE=ON -DLLAMA_CURL=OFF``, Release) into
``$SWIFTK_HOME/llamacpp/<version>/build`` and reused by every later run. llama.cpp's users run these tools
(``llama-bench``, ``llama-server``), not the Python wrapper, so the benches compare against them.

    python -m bench.native_llamacpp            # build (or find) it; print the binaries and llama.cpp's build info

``build_info()`` records what a result was measured against: the sdist version, llama.cpp's own build number and
commit (``llama-bench -o json``) and the CPU features its build uses (``system_info``).

ik_llama.cpp (Kawrakow's CPU fork: row-interleaved quants, run-time repacking ``-rtr``, its own matmuls and flash
attention) is the other peer: ``ensure_ik()`` builds its ``llama-bench`` from a checkout or a git snapshot of
github.com/ikawrakow/ik_llama.cpp named by ``--ik-src`` or ``$SWIFTK_IK_LLAMA`` (a snapshot may lack a few large
blobs, web-UI bundles and vocab files; they are skipped and llama-bench builds without them) into
``$SWIFTK_HOME/ik_llama/build``, the same CMake flags, and records the commit.

    python -m bench.native_llamacpp --ik-src ~/src/ik_llama.cpp
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"   # llama-cpp-python sdist whose vendor/llama.cpp is built
TARGETS = ("llama-bench", "llama-server")


def root() -> Path:
    from swiftk.home import swiftk_home

    return Path(swiftk_home()) / "llamacpp" / VERSION


def binary(name: str) -> Path:
    return root() / "build" / "bin" / name


def _say(msg: str) -> None:
    print(f"[native llama.cpp] {msg}", file=sys.stderr, flush=True)


def ensure() -> Path:
    """The build folder, building it first when a target is missing (~5 min on 2 cores, a line per step)."""
    if all(binary(t).is_file() for t in TARGETS) and not _amx_faults(root() / "build"):
        return root() / "build"
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("native llama.cpp needs cmake on PATH")
    src = root() / "src"
    if not (src / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory() as d:
            _say(f"downloading the llama-cpp-python {VERSION} sdist (its vendored llama.cpp source)")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                            f"llama-cpp-python=={VERSION}", "-d", d], check=True)
            sdist = next(Path(d).glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(sdist) as tf:
                tf.extractall(d, filter="data")
            vendored = next(Path(d).glob("llama_cpp_python-*/vendor/llama.cpp"))
            tmp = src.with_name("src.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(vendored, tmp)
            os.replace(tmp, src)
    build = root() / "build"
    _configure_and_build(cmake, src, build, [])
    if _amx_faults(build):
        # -march=native turns on AMX where /proc/cpuinfo lists it, but a VM may list it without letting a process
        # use the tiles: llama-bench's prompt pass then dies on SIGILL (seen on a KVM guest of an AMX Xeon). GCC
        # keeps explicit -mno-* flags whatever -march comes later, so this is the native build minus AMX.
        _say("this build's AMX kernels die on SIGILL here (AMX listed but not usable): rebuilding without AMX")
        _configure_and_build(cmake, src, build, [f"-DCMAKE_{lang}_FLAGS={NO_AMX}" for lang in ("C", "CXX")])
        (build / "NO_AMX").write_text(NO_AMX + "\n")
    return build


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def _configure_and_build(cmake: str, src: Path, build: Path, extra: list, targets=TARGETS, minutes: int = 5) -> None:
    (build / "AMX_OK").unlink(missing_ok=True)   # a new build is probed again
    t0 = time.perf_counter()
    _say(f"configuring {src} (cmake -DGGML_NATIVE=ON -DLLAMA_CURL=OFF {' '.join(extra)}, Release)")
    subprocess.run([cmake, "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *extra], check=True,
                   stdout=subprocess.DEVNULL)
    _say(f"building {', '.join(targets)} (~{minutes} min on 2 cores)")
    subprocess.run([cmake, "--build", str(build), "--target", *targets, "-j", str(os.cpu_count() or 2)], check=True,
                   stdout=subprocess.DEVNULL)
    _say(f"built in {time.perf_counter() - t0:.0f} s")


def _amx_faults(build: Path) -> bool:
    """True when this build uses AMX and its prompt pass dies on SIGILL (one 64-token llama-bench run)."""
    cache = (build / "CMakeCache.txt").read_text(errors="replace") if (build / "CMakeCache.txt").is_file() else ""
    if "amx" not in Path("/proc/cpuinfo").read_text(errors="replace") or "mno-amx" in cache:
        return False
    if (build / "AMX_OK").is_file():   # probed once after this build
        return False
    from swiftk.loading.registry import resolve_model

    r = subprocess.run([str(build / "bin" / "llama-bench"), "-m", str(resolve_model("smollm2-135m")), "-t", "1",
                        "-p", "64", "-n", "0", "-r", "1"], capture_output=True, timeout=300)
    if r.returncode in (-4, 132):
        return True
    (build / "AMX_OK").write_text("a 64-token llama-bench prompt pass ran\n")
    return False


def _ggml_version() -> str | None:
    """The vendored ggml's version: the sdist carries no git history, so llama.cpp itself reports commit unknown
    (the sdist's version pins the source)."""
    try:
        text = (root() / "src" / "ggml" / "CMakeLists.txt").read_text()
    except OSError:
        return None
    parts = dict(re.findall(r"set\(GGML_VERSION_(MAJOR|MINOR|PATCH) (\d+)\)", text))
    return ".".join(parts[k] for k in ("MAJOR", "MINOR", "PATCH")) if len(parts) == 3 else None


def build_info(gguf: Path, threads: int) -> dict:
    """llama.cpp's own account of the build: version, commit, and the CPU backend's features (one tiny run)."""
    r = subprocess.run([str(binary("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", "1",
                        "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=300)
    no_amx = (root() / "build" / "NO_AMX").is_file()
    info = {"sdist": f"llama-cpp-python=={VERSION} vendor/llama.cpp",
            "cmake": "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" + (f" -DCMAKE_C(XX)_FLAGS='{NO_AMX}'" if no_amx else ""),
            "bin": str(binary("llama-bench").parent), "ggml_version": _ggml_version()}
    try:
        row = json.loads(r.stdout)[0]
        info.update({k: row.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends")})
    except (ValueError, IndexError, KeyError):
        info["error"] = r.stderr[-500:]
    sysinfo = [ln for ln in r.stderr.splitlines() if "system_info" in ln or "CPU :" in ln]
    if sysinfo:
        info["system_info"] = sysinfo[-1].strip()
    return info


IK_ENV = "SWIFTK_IK_LLAMA"
IK_TARGETS = ("llama-bench",)


def ik_root() -> Path:
    from swiftk.home import swiftk_home

    return Path(swiftk_home()) / "ik_llama"


def ik_binary(name: str) -> Path:
    return ik_root() / "build" / "bin" / name


def ensure_ik(src=None) -> Path | None:
    """ik_llama.cpp's build folder, built first from ``src`` (else $SWIFTK_IK_LLAMA) when its llama-bench is missing;
    None when there is neither a build nor a source (the benches then say that the ik arms did not run)."""
    if all(ik_binary(t).is_file() for t in IK_TARGETS):
        return ik_root() / "build"
    src = src or os.environ.get(IK_ENV)
    if not src:
        return None
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("ik_llama.cpp needs cmake on PATH")
    tree = ik_root() / "src"
    if not (tree / "CMakeLists.txt").is_file():
        tmp = tree.with_name("src.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        commit, missing = _export(Path(src).expanduser(), tmp)
        (tmp / "SWIFTK_SOURCE.json").write_text(json.dumps({"from": str(src), "commit": commit, "missing": missing}))
        os.replace(tmp, tree)
        _say(f"ik_llama.cpp {commit} exported to {tree}" + (f" ({len(missing)} blobs missing from the snapshot)"
                                                             if missing else ""))
    # ik keeps llama-bench among the examples (mainline moved it to tools/)
    _configure_and_build(cmake, tree, ik_root() / "build", ["-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=OFF"],
                         IK_TARGETS, minutes=17)
    return ik_root() / "build"


def _export(src: Path, dest: Path) -> tuple:
    """(commit, blobs missing) after writing ``src``'s HEAD tree to ``dest``: ``src`` a work tree or a git directory
    (bare, e.g. a snapshot), whose absent blobs are skipped where `git archive` would stop."""
    git = ["git", "-C", str(src)] if (src / ".git").exists() else ["git", "--git-dir", str(src)]
    commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    listing = subprocess.run(git + ["ls-tree", "-r", "-z", "HEAD"], capture_output=True, check=True).stdout
    entries = []
    for item in listing.split(b"\0"):
        if item:
            meta, path = item.split(b"\t", 1)
            mode, kind, sha = meta.split()
            if kind == b"blob":
                entries.append((mode, sha.decode(), path.decode()))
    cat = subprocess.run(git + ["cat-file", "--batch"], input="".join(f"{sha}\n" for _, sha, _ in entries).encode(),
                         capture_output=True, check=True).stdout
    missing, at = [], 0
    for mode, sha, path in entries:
        end = cat.index(b"\n", at)
        head = cat[at:end].split()
        at = end + 1
        if head[-1] == b"missing":
            missing.append(path)
            continue
        size = int(head[2])
        data, at = cat[at:at + size], at + size + 1
        out = dest / path
        out.parent.mkdir(parents=True, exist_ok=True)
        if mode == b"120000":
            os.symlink(data.decode(), out)
        else:
            out.write_bytes(data)
            if mode == b"100755":
                out.chmod(0o755)
    return commit, missing


def ik_build_info(gguf: Path, threads: int) -> dict:
    """What the ik arms ran: the exported commit, blobs the snapshot lacked, and llama-bench's own build fields."""
    info = {"repo": "github.com/ikawrakow/ik_llama.cpp", "bin": str(ik_binary("llama-bench").parent),
            "cmake": "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_EXAMPLES=ON"}
    try:
        info.update(json.loads((ik_root() / "src" / "SWIFTK_SOURCE.json").read_text()))
    except (OSError, ValueError):
        pass
    r = subprocess.run([str(ik_binary("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", "1",
                        "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=300)
    try:
        row = json.loads(r.stdout)[0]
        info.update({k: row.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends")})
    except (ValueError, IndexError, KeyError):
        info["error"] = r.stderr[-500:]
    return info


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ik-src", default=None, help=f"ik_llama.cpp checkout or git snapshot (else ${IK_ENV})")
    a = ap.parse_args(argv)
    build = ensure()
    for t in TARGETS:
        print(binary(t))
    from swiftk.loading.registry import resolve_model

    print(json.dumps(build_info(resolve_model("smollm2-135m"), 2), indent=1))
    ik = ensure_ik(a.ik_src)
    if ik is None:
        print(f"ik_llama.cpp: not built (give --ik-src or ${IK_ENV})")
    else:
        print(json.dumps(ik_build_info(resolve_model("smollm2-135m"), 2), indent=1))
    return 0 if build.is_dir() else 1


if __name__ == "__main__":
    raise SystemExit(main())
