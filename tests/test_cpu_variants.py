"""The portable variant of the CPU kernel library (kernels/cpu/variants.json): built here with CMake as a wheel built
with SWIFTK_CPU_VARIANTS=all would build it, loaded by a process that is handed an install folder holding only it,
and checked against the library this machine installed. The float kernels (matmul, layer loop, attention, exp,
top-k) are written once over cpu_simd.h, so the portable build runs the same code on an 8-float struct: its greedy
speculation must equal its own plain decoding, and with float32 activations its logits must match the SIMD build's
up to the float summation order. (With int8 activations they are not compared: the integer products agree bit for
bit on every ISA, tests/test_cpu_qdot.py, but a float difference of one ulp upstream can move an activation across a
rounding boundary of its int8 quantization, and 30 layers carry that into the logits: seen here up to 1.0 on
SmolLM2's, against 2.5e-5 with float32 activations.)"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from swiftk.runtime.ops import native, native_build

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(r"""
    import json, sys
    from pathlib import Path
    import torch
    from swiftk.runtime.ops import native
    native.INSTALLED = Path(sys.argv[1])
    import swiftk
    from swiftk.runtime.ops import cpu_topk
    prompt = "def fibonacci(n):"
    eng = swiftk.load(sys.argv[2], persist=False)   # int8 activations on the file's blocks, the default
    ar = eng.generate(prompt, max_new_tokens=24, method="autoregressive").token_ids
    spec = eng.generate(prompt, max_new_tokens=24).token_ids
    exact = swiftk.load(sys.argv[2], persist=False, activations="float32")
    logits = exact.logits(exact.tokenizer.encode(prompt))[-1]
    # a float16 cache: the portable build rounds k, v in C (no F16C), the others with the instruction
    half = swiftk.load(sys.argv[2], persist=False, activations="float32", kv_cache="float16")
    ids = half.tokenizer.encode(prompt * 20)
    half_logits = half.logits(ids)[-1]
    exact.logits(ids)   # layer 0's k, v depend on the embeddings alone: the half cache holds them rounded, exactly
    n = len(ids)
    layer0_rounded = bool(torch.equal(exact.cache.data[0, :, :, :n].half(), half.cache.data[0, :, :, :n]))
    half_ar = half.generate(prompt, max_new_tokens=24, method="autoregressive").token_ids
    half_spec = half.generate(prompt, max_new_tokens=24).token_ids
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1000, generator=g)
    x[1, 17] = float("nan")
    x[2, :] = 0.5                      # ties: the lower index first
    x[3, 999] = 1e9
    top = cpu_topk.topk_rows(x, 8)
    def ref_row(r):   # torch.topk's order: NaN first, then larger, equal values by lower index
        r = r.tolist()
        return sorted(range(len(r)), key=lambda i: (r[i] == r[i], -r[i] if r[i] == r[i] else 0.0, i))[:8]
    ref = torch.tensor([ref_row(r) for r in x])
    json.dump({"source": native.source(), "width": int(native.library().swk_vector_width()), "ar": ar,
               "spec": spec, "logits": logits.tolist(), "topk_ok": bool(torch.equal(top, ref)),
               "half_logits": half_logits.tolist(), "half_ar": half_ar, "half_spec": half_spec,
               "layer0_rounded": layer0_rounded}, sys.stdout)
""")


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """An install folder holding only the portable variant, built from this checkout's kernels/cpu."""
    if shutil.which("cmake") is None or shutil.which(os.environ.get("CXX") or "c++") is None:
        pytest.skip("cmake and a C++ compiler are needed")
    root = tmp_path_factory.mktemp("portable")
    out, build = root / "_native", root / "build"
    subprocess.run(["cmake", "-S", str(REPO / "kernels" / "cpu"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DSWIFTK_CPU_VARIANTS=portable", f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}"],
                   check=True, capture_output=True)
    r = subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lib = out / "swiftk_cpu-portable.so"
    entry = {"file": lib.name, **native_build.digest(lib)}
    (out / "manifest.json").write_text(json.dumps({"sources": native.sources_digest(), "cpu": "a build host",
                                                   "variants": {"portable": entry}}))
    return out


def _run(folder, model):
    r = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(model)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "SWIFTK_PERSIST": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_portable_variant_builds_runs_and_agrees_with_this_machines(portable, smollm2_path):
    path, variant = native.installed()
    if path is None:
        pytest.skip(f"no installed kernel library to compare with ({variant})")
    got = _run(portable, smollm2_path)
    assert got["source"].startswith("installed (portable)"), got["source"]
    assert got["width"] == 8
    assert got["topk_ok"]
    assert got["spec"] == got["ar"], "greedy speculation differs from plain decoding in the portable build"
    assert got["half_spec"] == got["half_ar"], "the same over a float16 KV cache"
    assert got["layer0_rounded"], "the portable build's float16 rounding differs from torch's (nearest even)"
    mine = _run(path.parent, smollm2_path)
    assert mine["source"].startswith(f"installed ({variant})") and mine["topk_ok"] and mine["layer0_rounded"]
    a, b = torch.tensor(got["logits"]), torch.tensor(mine["logits"])
    # the same model in another float summation order: close, not equal
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-3), (a - b).abs().max()
    assert int(a.argmax()) == int(b.argmax())
    # over a float16 cache the two builds' keys can round to neighbouring halves where their float32 k differ in
    # the last bits: close within a half's ulp carried through the layers
    a16, b16 = torch.tensor(got["half_logits"]), torch.tensor(mine["half_logits"])
    assert torch.allclose(a16, b16, rtol=1e-3, atol=2e-2), (a16 - b16).abs().max()
    assert int(a16.argmax()) == int(b16.argmax())
