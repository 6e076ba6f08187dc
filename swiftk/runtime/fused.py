"""The CPU fast path of Model.run_layers: whole runs of layers in one C call (kernels/cpu/cpu_decode.cpp), with the
per-cache address tables it reads. A mixin of Model, apart so model.py reads as the op-by-op definition."""
from __future__ import annotations

import torch

from ..errors import SwiftkError
from .ops import cpu_layers, native
from .ops import reference as reference_ops
from .ops.masks import BoundedMask, TreeMask
from .weights import KERNEL_MAX_ROWS, fused_layer_table

# Rows of one fused pass over several sequences (forward_batch): each row is computed on its own, so any count is
# exact; more rows run as several passes (each reads the weights once more).
BATCH_MAX_ROWS = 256


def kv_type(cache) -> int:
    """The C loop's code of the cache's element type (csrc/include/swiftk_cpu.h SWK_KV_*)."""
    return {torch.float32: 0, torch.float16: 1}[cache.data.dtype]


class FusedCPULayers:
    """Needs from Model: cfg, scale, inv_freq, layers, _fused_tables, _fused_fl, _rope_table, _check_tree_fits,
    _visibility, embed_rows, final_logits."""

    def _visible(self, T, slots, cache, attn_mask) -> tuple:
        """(S, vis [T, S] bool) of one sequence's rows: a TreeMask's prefix and ancestors, a dense mask, or causal by
        slot (None)."""
        if isinstance(attn_mask, TreeMask):
            self._check_tree_fits(attn_mask, T, cache)
            return attn_mask.prefix_len + T, attn_mask.dense()
        dense = attn_mask.mask if isinstance(attn_mask, BoundedMask) else attn_mask
        return self._visibility(T, slots, cache, dense)

    def _layers_fused(self, h, start, end, stop, positions, slots, cache, attn_mask, flags, capture):
        """`_layers` on CPU through kernels/cpu/cpu_decode.cpp: one C call per run of layers (two around a captured
        layer); same results as the op-by-op loop up to float rounding."""
        c = self.cfg
        T = h.shape[0]
        S, vis = self._visible(T, slots, cache, attn_mask)
        vis = vis.contiguous()
        slots64 = slots.to(torch.int64).contiguous()
        if int(slots64.min()) < 0 or int(slots64.max()) >= cache.max_slots:
            raise SwiftkError(f"slots must lie in [0, {cache.max_slots})")
        if not bool(vis.any(dim=1).all()):
            raise SwiftkError("every token must attend to at least one slot")
        cos, sin = self._rope_rows(positions)
        table, wtypes = self._fused_table(cache)
        fl = self._fused_flags(flags)
        h = h.contiguous().clone()
        fn, width = cpu_layers.layers_fn(), table.shape[1]
        native.sync_threads()   # the block matmuls inside take the pool's default count

        def run(a, b):
            if b <= a:
                return
            if fn(b - a, table.data_ptr() + 8 * width * a, wtypes.data_ptr() + 16 * a, fl.data_ptr() + 2 * a, T,
                  c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size, c.rms_eps, self.scale,
                  cache.max_slots, slots64.data_ptr(), cos.data_ptr(), sin.data_ptr(), vis.data_ptr(), S,
                  h.data_ptr(), torch.get_num_threads(), kv_type(cache)) != 0:   # -1 arguments, -2 out of memory
                raise SwiftkError(f"cpu decode kernel failed a pass of {T} tokens over {S} slots (its arguments "
                                  "were rejected or its buffers could not be allocated)")

        captured = None
        if capture is not None and start <= capture < end:
            run(start, capture)
            captured = h.clone()
            run(capture, end)
        else:
            run(start, end)
            if capture is not None:
                captured = h  # every sublayer from ``capture`` on was skipped (or it is past the end): h is its input
        return h, None, captured

    def _layers_fused_chunks(self, h, start, end, stop, positions, slots, cache, flags, capture):
        """A causal pass longer than the C loop's passes (a prefill, slots increasing) as consecutive passes of
        KERNEL_MAX_ROWS tokens: each sees the slots the ones before it wrote, so the result is the pass's. Each row
        is computed as a decode step computes it, so a prompt's KV cache is the one decoding it token by token
        would write; and the loop's attention and elementwise ops beat torch's at prefill sizes (docs/performance.md)."""
        outs, caps = [], []
        for i in range(0, h.shape[0], KERNEL_MAX_ROWS):
            j = min(h.shape[0], i + KERNEL_MAX_ROWS)
            hh, _, cap = self._layers_fused(h[i:j], start, end, stop, positions[i:j], slots[i:j], cache, None, flags,
                                            capture)
            outs.append(hh)
            caps.append(cap)
        return torch.cat(outs), None, (torch.cat(caps) if capture is not None else None)

    def _forward_fused_batch(self, parts: list) -> list:
        """Model.forward_batch on the fused loop: the rows of every part (a sequence with its own cache) in one
        swk_layers_multi call per BATCH_MAX_ROWS rows, then the final norm and LM head over the rows asked for."""
        groups, cur, n = [], [], 0
        for p in parts:
            if cur and n + p.tokens.shape[0] > BATCH_MAX_ROWS:
                groups.append(cur)
                cur, n = [], 0
            cur.append(p)
            n += p.tokens.shape[0]
        groups.append(cur)
        if len(groups) > 1:
            return [lg for g in groups for lg in self._forward_fused_batch(g)]
        c = self.cfg
        caches = [p.cache for p in parts]
        if len({(x.max_slots, x.data.dtype) for x in caches}) != 1:
            raise SwiftkError("forward_batch: the parts' caches must have the same number of slots and type")
        sizes = [p.tokens.shape[0] for p in parts]
        T = sum(sizes)
        visible = [self._visible(n, p.slots, p.cache, p.mask) for n, p in zip(sizes, parts)]
        S = max(s for s, _ in visible)
        vis = torch.zeros(T, S, dtype=torch.bool)
        r = 0
        for n, (s, v) in zip(sizes, visible):
            vis[r:r + n, :s] = v
            r += n
        slots64 = torch.cat([p.slots for p in parts]).to(torch.int64).contiguous()   # range and visibility: C checks
        cos, sin = self._rope_rows(torch.cat([p.positions for p in parts]))
        table, wtypes = self._fused_table(caches[0])
        kv_col = table.shape[1] - 1   # P_KV, the last address of a layer's row
        kvs = torch.stack([self._fused_table(x)[0][:, kv_col] for x in caches]).contiguous()
        row_cache = torch.tensor([i for i, n in enumerate(sizes) for _ in range(n)], dtype=torch.int64)
        fl = self._fused_flags(self._no_skip)
        h = self.embed_rows(torch.cat([p.tokens for p in parts])).contiguous().clone()
        native.sync_threads()
        if cpu_layers.layers_multi_fn()(
                c.n_layers, table.data_ptr(), wtypes.data_ptr(), fl.data_ptr(), T, c.hidden_size, c.n_heads,
                c.n_kv_heads, c.head_dim, c.intermediate_size, c.rms_eps, self.scale, caches[0].max_slots,
                slots64.data_ptr(), cos.data_ptr(), sin.data_ptr(), vis.contiguous().data_ptr(), S, h.data_ptr(),
                torch.get_num_threads(), len(parts), kvs.data_ptr(), row_cache.data_ptr(), kv_type(caches[0])) != 0:
            raise SwiftkError(f"cpu decode kernel failed a batched pass of {T} tokens over {S} slots (its arguments "
                              "were rejected: a slot out of range, a row that sees none; or its buffers could not be "
                              "allocated)")
        idx, counts, r = [], [], 0
        for n, p in zip(sizes, parts):
            want = torch.arange(n) if p.logits_idx is None else p.logits_idx.to(torch.int64)
            idx.append(want + r)
            counts.append(want.numel())
            r += n
        logits = self.final_logits(h, None, torch.cat(idx), None)
        return list(torch.split(logits, counts))

    def _rope_rows(self, positions) -> tuple:
        """cos/sin [T, hd/2] of ``positions``, rows of a table computed once (grown by doubling): the same values
        (tests/test_cpu_decode.py), but no transcendental per pass, and no torch op that opens a thread pool of its
        own on whatever thread decodes (MKL's cos did, on a worker thread: docs/design.md, threads)."""
        n = int(positions.max()) + 1
        if self._rope_table is None or self._rope_table[0].shape[0] < n:
            size = max(n, 4352, 2 * (0 if self._rope_table is None else self._rope_table[0].shape[0]))
            self._rope_table = reference_ops.rope_cos_sin(torch.arange(size), self.inv_freq)
        return self._rope_table[0][positions].contiguous(), self._rope_table[1][positions].contiguous()

    def _fused_table(self, cache):
        """(addresses [n_layers, width] int64, weight types [n_layers, 4] int32) for the C layer loop, per cache."""
        key = (cache.data.data_ptr(), cache.max_slots)
        got = self._fused_tables.get(key)
        if got is not None:
            return got

        got = fused_layer_table(self.layers, cache)
        if len(self._fused_tables) >= 64:   # an engine makes a cache per batch slot; never grow without bound
            self._fused_tables.clear()
        self._fused_tables[key] = got
        return got

    def _fused_flags(self, flags: list) -> torch.Tensor:
        if self._fused_fl[0] is not flags:
            self._fused_fl = (flags, torch.tensor(flags, dtype=torch.uint8))
        return self._fused_fl[1]
