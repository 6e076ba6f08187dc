"""runtime/hugepages.py and the loader's weight buffer: block weights live in one buffer on a 2 MiB boundary,
advised for transparent huge pages before their first touch; where the system allows them (THP mode madvise or
always), the kernel backs that buffer with 2 MiB pages, which /proc/self/smaps shows."""
import pytest
import torch

from swiftk.errors import SwiftkError
from swiftk.loading.loaders import load_checkpoint
from swiftk.runtime import hugepages
from swiftk.runtime.weights import BlockWeight

MiB = 1 << 20


def _thp_allowed() -> bool:
    return hugepages.status().split()[0] in ("madvise", "always")


def test_a_buffer_starts_on_a_huge_page_and_gets_huge_pages_where_the_system_allows():
    buf = hugepages.empty(9 * MiB + 5)
    assert buf.dtype == torch.uint8 and buf.numel() == 9 * MiB + 5
    assert buf.data_ptr() % hugepages.HUGE == 0
    buf.fill_(7)   # the first touch: the page faults that get huge pages
    assert int(buf[-1]) == 7 and int(buf.sum(dtype=torch.int64)) == 7 * buf.numel()
    if not _thp_allowed():
        pytest.skip(f"transparent huge pages: {hugepages.status()}: only the buffer's layout could be checked")
    assert hugepages.huge_bytes(buf.data_ptr(), buf.numel()) >= 4 * MiB


def test_small_buffers_and_the_switch_give_plain_memory(monkeypatch):
    small = hugepages.empty(1000)
    assert small.numel() == 1000
    monkeypatch.setattr(hugepages, "ENABLED", False)
    plain = hugepages.empty(4 * MiB)
    assert plain.numel() == 4 * MiB and plain.untyped_storage().nbytes() == 4 * MiB   # no padding: torch.empty
    assert "off" in hugepages.status() or not hugepages.status().startswith(("madvise", "always"))


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("SWIFTK_HUGE_PAGES", "yes")
    with pytest.raises(SwiftkError, match="SWIFTK_HUGE_PAGES"):
        hugepages.empty(4 * MiB)
    monkeypatch.setenv("SWIFTK_HUGE_PAGES", "0")
    assert "off" in hugepages.status() or hugepages.status().startswith(("not Linux", "no transparent"))


def test_the_loader_puts_every_block_matrix_in_one_buffer(smollm2_path):
    ck = load_checkpoint(smollm2_path, native=True, pack=True)
    blocks = {n: t for n, t in ck.tensors.items() if isinstance(t, BlockWeight)}
    assert len(blocks) > 100
    storages = {raw.untyped_storage().data_ptr() for t in blocks.values() for raw, _ in t.parts}
    assert len(storages) == 1
    # a layer's q, k, v lie back to back: the Model's stacked matrix is a view, not a copy
    q, k, v = (blocks[f"model.layers.3.self_attn.{x}_proj.weight"].parts[0][0] for x in "qkv")
    assert q.data_ptr() + q.numel() == k.data_ptr() and k.data_ptr() + k.numel() == v.data_ptr()
    stacked = BlockWeight.cat([blocks[f"model.layers.3.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert len(stacked.parts) == 1 and stacked.parts[0][0].data_ptr() == q.data_ptr()
    total = sum(raw.numel() for t in blocks.values() for raw, _ in t.parts)
    if not _thp_allowed():
        pytest.skip(f"transparent huge pages: {hugepages.status()}")
    ptr = q.untyped_storage().data_ptr()
    assert hugepages.huge_bytes(ptr, total) >= 0.9 * total
