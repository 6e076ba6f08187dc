"""kernels/cpu/cpu_linear.cpp against its torch twin (swiftk.runtime.ops.reference.linear), batch invariance, weight formats."""
import pytest
import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.model import QWeight
from swiftk.runtime.ops import cpu_linear, native
from swiftk.runtime.ops import reference as R

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason=f"CPU kernel unavailable: {cpu_linear.status()}")


def _w(fmt, N, K, g):
    w = torch.randn(N, K, generator=g)
    if fmt == "float32":
        return w, None
    if fmt == "bfloat16":
        return w.bfloat16(), None
    q = QWeight.quantize(w)
    return q.q, q.scale


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("M,K,N", [(1, 64, 8), (3, 576, 100), (5, 100, 37), (8, 33, 4), (17, 256, 9), (64, 48, 130)])
def test_equals_torch_twin(fmt, M, K, N):
    """Odd K (vector tail), N not a multiple of the row block, M beyond one register tile."""
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    w, s = _w(fmt, N, K, g)
    x = torch.randn(M, K, generator=g)
    got = cpu_linear.linear(x, w, s)
    want = R.linear(x.double(), w.double(), None if s is None else s.double()).float()
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * K ** 0.5)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_batch_invariant(fmt):
    """A row's result does not depend on how many rows share the call, nor on the thread count: a verify pass
    gives each token bit-identical logits to a one-token step."""
    g = torch.Generator().manual_seed(7)
    w, s = _w(fmt, 300, 576, g)
    x = torch.randn(11, 576, generator=g)
    full = cpu_linear.linear(x, w, s)
    for m in range(11):
        assert torch.equal(cpu_linear.linear(x[m:m + 1], w, s)[0], full[m])
    for M in (2, 3, 4, 5, 6, 7, 8, 9, 10):   # every tail of 3- and 4-row tiles
        assert torch.equal(cpu_linear.linear(x[:M], w, s), full[:M])
    assert torch.equal(cpu_linear.linear(x, w, s, threads=1), full)


def test_bfloat16_activations_go_through_float32():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=g)
    x = torch.randn(2, 64, generator=g).bfloat16()
    assert torch.allclose(cpu_linear.linear(x, w), x.float() @ w.T, atol=1e-4)


def test_bad_operands_raise():
    w = torch.randn(8, 16)
    with pytest.raises(SwiftkError, match="unsupported operands"):
        cpu_linear.linear(torch.randn(2, 15), w)                 # K mismatch
    with pytest.raises(SwiftkError, match="unsupported operands"):
        cpu_linear.linear(torch.randn(2, 16), w.T.contiguous().T)  # non-contiguous weight
    with pytest.raises(SwiftkError, match="scale"):
        cpu_linear.linear(torch.randn(2, 16), w.to(torch.int8))  # int8 without scale
    with pytest.raises(SwiftkError, match="scale"):
        cpu_linear.linear(torch.randn(2, 16), w, torch.ones(8))  # float weight with a scale
    with pytest.raises(SwiftkError, match="scale must be"):
        cpu_linear.linear(torch.randn(2, 16), w.to(torch.int8), torch.ones(7))


def test_quantize_round_trip():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(50, 70, generator=g)
    w[3] = 0.0  # an all-zero row must not divide by zero
    q = QWeight.quantize(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (50,)
    err = (q.dequantize() - w).abs().max(dim=1).values
    assert torch.all(err <= q.scale * 0.5 + 1e-7)           # at most half a step per row
    assert torch.equal(q.dequantize()[3], torch.zeros(70))
    rows = q[torch.tensor([4, 1])]
    assert torch.equal(rows.q, q.q[[4, 1]]) and torch.equal(rows.scale, q.scale[[4, 1]])


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv(native.ENV_VAR, "0")
    native.reset()
    try:
        assert not cpu_linear.available()
        assert "SWIFTK_CPU_KERNELS=0" in cpu_linear.status()
        with pytest.raises(SwiftkError, match="unavailable"):
            cpu_linear.linear(torch.randn(1, 4), torch.randn(2, 4))
    finally:
        monkeypatch.delenv(native.ENV_VAR)
        native.reset()
    assert cpu_linear.available()


def test_failed_build_falls_back_with_reason(monkeypatch, tmp_path):
    """A compiler that fails (the first-use build: SWIFTK_CPU_KERNELS=build passes over the installed library):
    the runtime says why and uses torch."""
    bad = tmp_path / "bad-cxx"
    bad.write_text("#!/bin/sh\necho 'bad-cxx 1.0'\n[ \"$1\" = --version ] && exit 0\necho 'no such luck' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CXX", str(bad))
    monkeypatch.setenv(native.ENV_VAR, "build")
    monkeypatch.setenv("SWIFTK_KERNEL_CACHE", str(tmp_path / "kernels"))
    native.reset()
    try:
        with pytest.warns(RuntimeWarning, match="no such luck"):
            assert not cpu_linear.available()
        assert "build failed" in cpu_linear.status()
        assert not list((tmp_path / "kernels").glob("*"))   # nothing half-written left
    finally:
        monkeypatch.delenv("CXX")
        monkeypatch.delenv(native.ENV_VAR)
        native.reset()
