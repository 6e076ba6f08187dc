"""kernels/cpu/cpu_topk.cpp (swiftk.runtime.ops.cpu_topk.topk_rows) against torch: argmax exactly (first maximal index, NaN
first), top-k as a stable sort by (value descending, index)."""
import pytest
import torch

from swiftk.runtime.ops import cpu_linear, cpu_topk

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="CPU kernels unavailable on this host")


def _reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """Larger first, ties by lower index, NaN above every number (ties among NaN by lower index)."""
    out = []
    for row in x.tolist():
        order = sorted(range(len(row)), key=lambda i: (0 if row[i] != row[i] else 1,
                                                       0.0 if row[i] != row[i] else -row[i], i))
        out.append(order[:k])
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("V,k", [(V, k) for V in (1, 7, 8, 9, 100, 49152) for k in (1, 2, 8) if k <= V])
def test_matches_torch(V, k):
    g = torch.Generator().manual_seed(V * 10 + k)
    x = torch.randn(5, V, generator=g)
    got = cpu_topk.topk_rows(x, k)
    assert torch.equal(got[:, 0], x.argmax(dim=-1))
    assert torch.equal(got, _reference(x, k) if V <= 100 else x.topk(k, dim=-1).indices)


def test_ties_nan_and_infinities():
    """Logits quantized to few values tie often: the lower index must win, as torch.argmax's does."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 4, (64, 300), generator=g).float()
    x[0, :] = float("-inf")
    x[1, 17] = float("inf")
    x[2, [5, 200]] = float("nan")
    x[3, 299] = float("nan")
    for k in (1, 3, 8):
        assert torch.equal(cpu_topk.topk_rows(x, k), _reference(x, k))
    assert torch.equal(cpu_topk.topk_rows(x, 1)[:, 0], x.argmax(dim=-1))


def test_one_row_and_views():
    x = torch.randn(3, 1000)[:, ::2]   # not contiguous: copied, same answer
    assert torch.equal(cpu_topk.topk_rows(x, 4), x.topk(4, dim=-1).indices)
    assert torch.equal(cpu_topk.topk_rows(x[1], 1), x[1].argmax().reshape(1))


def test_bad_arguments_fall_back_or_raise():
    x = torch.randn(2, 10)
    assert torch.equal(cpu_topk.topk_rows(x.double(), 2), x.double().topk(2, dim=-1).indices)   # torch path
    with pytest.raises(RuntimeError):
        cpu_topk.topk_rows(x, 11)   # torch's own error for k > V


def _reference_np(x: torch.Tensor, k: int) -> torch.Tensor:
    """_reference for long rows: a stable sort on (NaN first, value descending, index)."""
    import numpy as np   # only here: the long-row reference

    a = x.numpy()
    out = []
    for row in a:
        nan = np.isnan(row)
        key = np.where(nan, 0.0, -row)
        order = np.lexsort((np.arange(len(row)), key, ~nan))
        out.append(order[:k])
    return torch.tensor(np.array(out), dtype=torch.int64)


@pytest.mark.parametrize("V", [32768, 49155, 151936])
def test_long_rows_split_across_threads_keep_the_order(V):
    """Rows of >= 32768 are scanned in slices, one per thread, then merged: every thread count gives the one-pass
    answer, ties and NaN at slice boundaries included."""
    g = torch.Generator().manual_seed(V)
    x = torch.randint(0, 40, (6, V), generator=g).float()   # many ties, some across slice boundaries
    x[0, :] = float("-inf")
    x[1, [V // 2 - 1, V // 2, V - 1]] = 100.0                # equal maxima on both sides of the middle
    x[2, [V // 3 + 1, V - 2]] = float("nan")
    x[3, V - 1] = 1000.0                                      # the best in the last, shortest slice
    want = {k: _reference_np(x, k) for k in (1, 8, 20)}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            for k, ref in want.items():
                assert torch.equal(cpu_topk.topk_rows(x, k), ref), (threads, k)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(want[1][:, 0], x.argmax(dim=-1))
