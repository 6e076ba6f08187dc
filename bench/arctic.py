"""ArcticInference's suffix decoding (SuffixDecoding, vLLM's ``suffix`` method) as a drafter for bench/replay.py.

The ``arctic-inference`` package targets vLLM on CUDA and does not install on a CPU-only machine, but its suffix
tree is a small C++ extension with a thin Python wrapper. ``python -m bench.arctic --build`` downloads the sdist
(``pip download --no-deps arctic-inference==0.3.0``), builds only that extension with CMake + nanobind (pip
installs ``nanobind==2.9.2`` into this environment if missing), and puts it with the wrapper under
``$SWIFTK_HOME/arctic/`` -- a benchmark peer, never a dependency of swiftk. ``python -m bench.arctic`` then runs a
self-check.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.0"


def home() -> Path:
    root = os.environ.get("SWIFTK_HOME")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "swiftk") / "arctic"


def build(dest: Path = None) -> Path:
    dest = dest or home()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
                        f"arctic-inference=={VERSION}", "-d", str(tmp)], check=True)
        sdist = next(tmp.glob("arctic_inference-*.tar.gz"))
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        src = next(tmp.glob("arctic_inference-*/"))
        try:
            import nanobind  # noqa: F401
        except ImportError:
            subprocess.run([sys.executable, "-m", "pip", "install", "nanobind==2.9.2"], check=True)
        b = tmp / "build"
        subprocess.run(["cmake", "-S", str(src / "csrc" / "suffix_decoding"), "-B", str(b),
                        f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"], check=True)
        subprocess.run(["cmake", "--build", str(b), "-j", "2"], check=True)
        pkg = dest / "arctic_inference" / "suffix_decoding"
        if pkg.exists():
            shutil.rmtree(pkg)
        pkg.mkdir(parents=True)
        (dest / "arctic_inference" / "__init__.py").write_text("")
        for f in ("__init__.py", "cache.py"):
            shutil.copy(src / "arctic_inference" / "suffix_decoding" / f, pkg / f)
        for so in glob.glob(str(b / "_C*.so")):
            shutil.copy(so, pkg)
    return dest


def suffix_cache_class():
    """ArcticInference's SuffixDecodingCache, from an installed package or a --build; None if neither."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
        return SuffixDecodingCache
    except ImportError:
        pass
    if (home() / "arctic_inference").is_dir():
        sys.path.insert(0, str(home()))
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
            return SuffixDecodingCache
        except ImportError:
            return None
    return None


class ArcticSuffix:
    """Replay drafter over ``SuffixDecodingCache``: the prompt as the request's local tree, earlier responses in
    the global tree, tree speculation with the package's defaults (match-length factor 1.0, min token prob 0.1,
    depth 64), at most ``budget - 1`` tokens."""

    name = "arctic-suffix"

    def __init__(self, max_tree_depth: int = 64, spec_factor: float = 1.0, min_token_prob: float = 0.1):
        cls = suffix_cache_class()
        if cls is None:
            raise RuntimeError("ArcticInference's suffix cache is not built: run python -m bench.arctic --build")
        self.cache = cls(max_tree_depth=max_tree_depth)
        self.spec_factor, self.min_prob = spec_factor, min_token_prob
        self.req, self.prompt_len, self.sent = 0, 0, 0

    def begin(self, prompt: list) -> None:
        self.req += 1
        self.cache.start_request(self.req, list(prompt))
        self.prompt_len, self.sent = len(prompt), 0

    def _sync(self, resp: list) -> None:
        """Hand the cache the response tokens it has not seen."""
        if len(resp) > self.sent:
            self.cache.add_active_response(self.req, resp[self.sent:])
            self.sent = len(resp)

    def propose(self, tokens: list, budget: int) -> list:
        self._sync(tokens[self.prompt_len:])
        d = self.cache.speculate(self.req, tokens, max_spec_tokens=max(0, budget - 1),
                                 max_spec_factor=self.spec_factor, min_token_prob=self.min_prob, use_tree_spec=True)
        kids = {}
        for i, p in enumerate(d.parents):
            kids.setdefault(p, []).append(i)
        chains = []

        def walk(i, path):
            path = path + [d.token_ids[i]]
            if i not in kids:
                chains.append(path)
            for c in kids.get(i, []):
                walk(c, path)

        for r in kids.get(-1, []):
            walk(r, [])
        return chains

    def end(self, output: list) -> None:
        self._sync(list(output))
        self.cache.stop_request(self.req)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="store_true")
    a = ap.parse_args(argv)
    if a.build:
        print("built into", build())
    d = ArcticSuffix()
    seq = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    d.begin(seq[:8])
    print("proposal after", seq, "->", d.propose(seq, 8))
    d.end(seq[8:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
