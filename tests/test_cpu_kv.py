"""kernels/cpu/cpu_kv.cpp (the CPU backend of kv_commit) against its torch twin, reference.kv_commit."""
import pytest
import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.ops import cpu_kv, reference

pytestmark = pytest.mark.skipif(not cpu_kv.available(), reason="no CPU kernel library")


@pytest.mark.parametrize("src,dst", [([5, 9, 12], [3, 4, 5]),          # a branch's path into the prefix
                                     ([4, 3, 6, 5], [3, 4, 5, 6]),      # overlapping, reordered
                                     ([7], [7]), ([], [])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])   # the cache types the kernel moves rows of
def test_kv_commit_equals_the_torch_twin(src, dst, dtype):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 2, 2, 16, 8, generator=g).to(dtype)
    want = cache.clone()
    reference.kv_commit(want, torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
    cpu_kv.kv_commit(cache, torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
    assert torch.equal(cache, want)


def test_kv_commit_rejects_slots_outside_the_cache_and_writes_nothing():
    cache = torch.randn(2, 2, 1, 8, 4)
    before = cache.clone()
    for src, dst in (([8], [0]), ([0], [-1]), ([1, 2], [3])):
        with pytest.raises(SwiftkError, match="kv_commit"):
            cpu_kv.kv_commit(cache, torch.tensor(src), torch.tensor(dst))
    assert torch.equal(cache, before)


def test_kv_commit_leaves_other_caches_to_torch():
    cache = torch.randn(2, 2, 1, 8, 4, dtype=torch.bfloat16)
    want = cache.clone()
    reference.kv_commit(want, torch.tensor([5]), torch.tensor([2]))
    cpu_kv.kv_commit(cache, torch.tensor([5]), torch.tensor([2]))
    assert torch.equal(cache, want)
