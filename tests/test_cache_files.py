"""Files swiftk writes into $SWIFTK_HOME are checked before use and rebuilt when damaged: the CPU kernel library
(a damaged one used to kill every later process with SIGBUS) and the corpus tables (shared per tokenizer,
bounded in number)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swiftk.ops import cpu_linear

CHECK = """
import torch, warnings
warnings.simplefilter("always")
from swiftk.ops import cpu_linear as c
assert c.available(), c.status()
x, w = torch.randn(3, 64), torch.randn(40, 64)
assert torch.allclose(c.linear(x, w), x @ w.T, atol=1e-4)
print("KERNEL OK")
"""


def _run(home):
    env = {**os.environ, "SWIFTK_HOME": str(home)}
    env.pop("SWIFTK_CPU_KERNELS", None)
    return subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not cpu_linear.available():
        pytest.skip(f"no CPU kernel on this host: {cpu_linear.status()}")
    home = tmp_path_factory.mktemp("home")
    out = _run(home)
    assert out.returncode == 0 and "KERNEL OK" in out.stdout, out.stderr[-2000:]
    return home


def _other_library() -> bytes:
    import _ctypes   # a valid shared library that is not swiftk's

    return Path(_ctypes.__file__).read_bytes()


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "other-library", "no-sidecar"])
def test_damaged_kernel_library_is_rebuilt(built, tmp_path, damage):
    home = tmp_path / "home"
    shutil.copytree(built, home, symlinks=True)
    (lib,) = (home / "build").glob("cpu_linear-*.so")
    data = lib.read_bytes()
    if damage == "truncated":
        lib.write_bytes(data[: len(data) // 3])
    elif damage == "flipped":
        lib.write_bytes(data[:4096] + bytes([data[4096] ^ 0xFF]) + data[4097:])
    elif damage == "empty":
        lib.write_bytes(b"")
    elif damage == "other-library":
        lib.write_bytes(_other_library())
    else:
        Path(str(lib) + ".sha256.json").unlink()
    out = _run(home)
    assert out.returncode == 0 and "KERNEL OK" in out.stdout, (out.returncode, out.stderr[-2000:])
    assert "rebuilding the CPU kernel library" in out.stderr
    assert lib.read_bytes() == data   # the same build back, checked again by its sidecar
    again = _run(home)   # and the next process uses it without a word
    assert again.returncode == 0 and "rebuilding" not in again.stderr


def test_corpus_tables_are_shared_per_tokenizer_and_bounded(tmp_path, monkeypatch):
    import swiftk.datastore as dsm

    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path))
    monkeypatch.setattr(dsm, "stdlib_ids", lambda tok, n: [5, 6, 7, 5, 6, 8, 5, 6, 7])

    class Tok:
        def __init__(self, fp):
            self.fp = fp

        def fingerprint(self):
            return self.fp

    a = dsm.engine_corpus(Tok("t1"), {"fingerprint": "model-file-1"}, 100)
    dsm.engine_corpus(Tok("t1"), {"fingerprint": "model-file-2"}, 100)   # another file, same tokenizer
    folder = tmp_path / "datastore"
    assert len(list(folder.glob("*.npz"))) == 1
    for i in range(dsm.MAX_CACHED + 3):
        dsm.engine_corpus(Tok(f"other-{i}"), {}, 100)
    assert len(list(folder.glob("*.npz"))) == dsm.MAX_CACHED
    assert a.lookup([5, 6]) == (7, 2, 2 / 3)
