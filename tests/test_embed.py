"""Embedding swiftk in C/C++ hosts (examples/, built here with CMake): decode_step runs one decode step of a tiny
model through the CPU C ABI (csrc/include/swiftk_cpu.h) and must match swiftk's own logits; embed_generate runs the
Python engine in an embedded interpreter and must stream the text that ``generate`` returns in process."""
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swiftk.runtime.config import from_hf_config
from swiftk.runtime.model import Model
from swiftk.runtime.ops import cpu_layers
from swiftk.runtime.ops import reference as reference_ops
from swiftk.runtime.weights import QWeight

ROOT = Path(__file__).resolve().parents[1]
_CXX = os.environ.get("CXX") or "c++"
pytestmark = [
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not found (examples/ builds with CMake)"),
    pytest.mark.skipif(shutil.which(_CXX) is None, reason=f"no C++ compiler ({_CXX}) found"),
    pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                       reason="the CPU kernels need x86-64 (AVX2+FMA or AVX-512)"),
]


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """examples/ configured and built once for this module (embed_generate only when pybind11 is importable)."""
    b = tmp_path_factory.mktemp("examples-build")
    cfg = ["cmake", "-S", str(ROOT / "examples"), "-B", str(b), f"-DPython_EXECUTABLE={sys.executable}"]
    try:
        import pybind11

        cfg.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
    except ImportError:
        cfg.append("-DSWIFTK_BUILD_EMBED=OFF")
    for cmd in (cfg, ["cmake", "--build", str(b), "-j", str(os.cpu_count() or 2)]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return b


def _save(path: Path, t: torch.Tensor) -> None:
    """The raw bytes decode_step reads (little-endian: these tests run on x86-64 only); bfloat16 as its bits."""
    t = t.detach().contiguous()
    path.write_bytes((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())


def _write_step(m: Model, d: Path, prefix: list, token: int, tol: float) -> torch.Tensor:
    """The inputs of one decode step of ``token`` after ``prefix`` (its KV cache filled by swiftk), and the logits
    swiftk's op-by-op torch path gives for it (returned, and written as expected_logits.bin)."""
    c, n = m.cfg, len(prefix)
    cache = m.new_cache(n + 3)
    m.forward(torch.tensor(prefix), torch.arange(n), torch.arange(n), cache)
    kv = cache.data.clone()   # slots [0, n); the step itself writes slot n
    cpu_layers.set_fused(False)
    try:
        logits = m.forward(torch.tensor([token]), torch.tensor([n]), torch.tensor([n]), cache)[0]
    finally:
        cpu_layers.set_fused(True)
    w0 = m.layers[0].wqkv
    wtype = 2 if isinstance(w0, QWeight) else 1 if w0.dtype == torch.bfloat16 else 0   # swiftk_cpu.h's SWK_W_*
    manifest = dict(n_layers=c.n_layers, hidden=c.hidden_size, heads=c.n_heads, kv_heads=c.n_kv_heads,
                    head_dim=c.head_dim, intermediate=c.intermediate_size, vocab=c.vocab_size,
                    max_slots=cache.max_slots, pos=n, eps=repr(c.rms_eps), scale=repr(m.scale), tol=repr(tol),
                    wtype=wtype, qkv_bias=int(m.layers[0].bqkv is not None))
    (d / "manifest.txt").write_text("".join(f"{k}={v}\n" for k, v in manifest.items()))

    def matrix(name, w):
        if isinstance(w, QWeight):
            _save(d / f"{name}.bin", w.q)
            _save(d / f"{name}.scale.bin", w.scale)
        else:
            _save(d / f"{name}.bin", w)

    for li, L in enumerate(m.layers):
        p = f"layer{li}."
        _save(d / f"{p}attn_norm.bin", L.attn_norm)
        _save(d / f"{p}mlp_norm.bin", L.mlp_norm)
        for name, w in (("wqkv", L.wqkv), ("wo", L.wo), ("wgu", L.w_gate_up), ("wdown", L.w_down)):
            matrix(p + name, w)
        if L.bqkv is not None:
            _save(d / f"{p}bqkv.bin", L.bqkv)
        _save(d / f"{p}kv.bin", kv[li])
    cos, sin = reference_ops.rope_cos_sin(torch.tensor([n]), m.inv_freq)
    _save(d / "cos.bin", cos[0])
    _save(d / "sin.bin", sin[0])
    _save(d / "x.bin", m.embed[token])
    _save(d / "norm.bin", m.norm)
    matrix("lm_head", m.lm_head)
    _save(d / "expected_logits.bin", logits)
    return logits


def _run_step(build, d):
    r = subprocess.run([str(build / "decode_step"), str(d), "2"], capture_output=True, text=True, timeout=120)
    out = dict(ln.split("=", 1) for ln in r.stdout.split() if "=" in ln)
    return r, out


PREFIX, TOKEN = [3, 17, 40, 8, 25, 11], 30


def _hf_model(arch, tiny_dir):
    """The llama of the tiny_dir fixture, or a small random Qwen2 (q/k/v biases, head_dim 12: vector tails)."""
    transformers = pytest.importorskip("transformers")
    if arch == "llama":
        return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).float().eval()
    torch.manual_seed(1)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    hf = transformers.Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in hf.parameters():   # the biases start at zero: make them count
            p.add_(torch.randn_like(p) * 0.02)
    return hf


@pytest.mark.parametrize("arch,weights", [("llama", None), ("llama", "bfloat16"), ("llama", "int8"), ("qwen2", None)])
def test_decode_step_matches_python(build, tiny_dir, tmp_path, arch, weights):
    hf = _hf_model(arch, tiny_dir)
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    m = Model(from_hf_config(hf.config.to_dict()), sd, weights=weights)
    logits = _write_step(m, tmp_path, PREFIX, TOKEN, tol=1e-4)
    if weights is None:   # swiftk's Python path is itself the transformers model's
        with torch.no_grad():
            ref = hf(torch.tensor([PREFIX + [TOKEN]])).logits[0, -1]
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    r, out = _run_step(build, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MATCH" in r.stdout.split()
    assert int(out["argmax"]) == int(logits.argmax())
    assert float(out["max_abs_diff"]) <= 1e-4


def test_decode_step_detects_wrong_logits(build, tiny_dir, tmp_path):
    hf = _hf_model("llama", tiny_dir)
    m = Model(from_hf_config(hf.config.to_dict()), {k: v.detach() for k, v in hf.state_dict().items()})
    logits = _write_step(m, tmp_path, PREFIX, TOKEN, tol=1e-4).clone()
    logits[7] += 0.01
    _save(tmp_path / "expected_logits.bin", logits)
    r, out = _run_step(build, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MISMATCH" in r.stdout.split()
    assert float(out["max_abs_diff"]) == pytest.approx(0.01, rel=0.05)
    (tmp_path / "x.bin").write_bytes(b"\0" * 12)   # a wrong shape is refused, not misread
    r, _ = _run_step(build, tmp_path)
    assert r.returncode == 2 and "x.bin" in r.stderr


def test_embed_generate_streams(build, tiny_dir):
    exe = build / "embed_generate"
    if not exe.exists():
        pytest.skip("pybind11 not installed: embed_generate not built")
    import swiftk

    prompt, n = "w1 w2 w3 w4", 12
    want = swiftk.load(str(tiny_dir)).generate(prompt, max_new_tokens=n).text
    env = {k: v for k, v in os.environ.items() if k != "SWIFTK_PYTHON"}   # the interpreter CMake was given
    r = subprocess.run([str(exe), str(tiny_dir), prompt, str(n)], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    streamed, sep, rest = r.stdout.partition("\n=== swiftk result: ")
    assert sep, r.stdout
    count, _, body = rest.partition(" pieces ===\n")
    assert body.endswith("\n=== end ===\n")
    text = body[: -len("\n=== end ===\n")]
    assert streamed == text == want
    assert int(count) > 1
