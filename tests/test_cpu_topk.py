"""kernels/cpu/cpu_topk.cpp (swiftk.runtime.ops.cpu_linear.topk_rows) against torch: argmax exactly (first maximal index, NaN
first), top-k as a stable sort by (value descending, index)."""
import pytest
import torch

from swiftk.runtime.ops import cpu_linear

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
    got = cpu_linear.topk_rows(x, k)
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
        assert torch.equal(cpu_linear.topk_rows(x, k), _reference(x, k))
    assert torch.equal(cpu_linear.topk_rows(x, 1)[:, 0], x.argmax(dim=-1))


def test_one_row_and_views():
    x = torch.randn(3, 1000)[:, ::2]   # not contiguous: copied, same answer
    assert torch.equal(cpu_linear.topk_rows(x, 4), x.topk(4, dim=-1).indices)
    assert torch.equal(cpu_linear.topk_rows(x[1], 1), x[1].argmax().reshape(1))


def test_bad_arguments_fall_back_or_raise():
    x = torch.randn(2, 10)
    assert torch.equal(cpu_linear.topk_rows(x.double(), 2), x.double().topk(2, dim=-1).indices)   # torch path
    with pytest.raises(RuntimeError):
        cpu_linear.topk_rows(x, 11)   # torch's own error for k > V
