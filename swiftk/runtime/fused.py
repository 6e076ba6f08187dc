"""The CPU fast path of Model.run_layers: whole runs of layers in one C call (kernels/cpu/cpu_decode.cpp), with the
per-cache address tables it reads. A mixin of Model, apart so model.py reads as the op-by-op definition."""
from __future__ import annotations

import torch

from ..errors import SwiftkError
from .ops import cpu_linear, native
from .ops import reference as reference_ops
from .ops.masks import BoundedMask, TreeMask
from .weights import KERNEL_MAX_ROWS, fused_layer_table


class FusedCPULayers:
    """Needs from Model: cfg, scale, inv_freq, layers, _fused_tables, _fused_fl, _check_tree_fits, _visibility."""

    def _layers_fused(self, h, start, end, stop, positions, slots, cache, attn_mask, flags, capture):
        """`_layers` on CPU through kernels/cpu/cpu_decode.cpp: one C call per run of layers (two around a captured
        layer); same results as the op-by-op loop up to float rounding."""
        c = self.cfg
        T = h.shape[0]
        if isinstance(attn_mask, TreeMask):
            self._check_tree_fits(attn_mask, T, cache)
            S, vis = attn_mask.prefix_len + T, attn_mask.dense()
        else:
            dense = attn_mask.mask if isinstance(attn_mask, BoundedMask) else attn_mask
            S, vis = self._visibility(T, slots, cache, dense)
        vis = vis.contiguous()
        slots64 = slots.to(torch.int64).contiguous()
        if int(slots64.min()) < 0 or int(slots64.max()) >= cache.max_slots:
            raise SwiftkError(f"slots must lie in [0, {cache.max_slots})")
        if not bool(vis.any(dim=1).all()):
            raise SwiftkError("every token must attend to at least one slot")
        cos, sin = (t.contiguous() for t in reference_ops.rope_cos_sin(positions, self.inv_freq))
        table, wtypes = self._fused_table(cache)
        fl = self._fused_flags(flags)
        h = h.contiguous().clone()
        fn, width = cpu_linear.layers_fn(), table.shape[1]
        native.sync_threads()   # the block matmuls inside take the pool's default count

        def run(a, b):
            if b <= a:
                return
            if fn(b - a, table.data_ptr() + 8 * width * a, wtypes.data_ptr() + 16 * a, fl.data_ptr() + 2 * a, T,
                  c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size, c.rms_eps, self.scale,
                  cache.max_slots, slots64.data_ptr(), cos.data_ptr(), sin.data_ptr(), vis.data_ptr(), S,
                  h.data_ptr(), torch.get_num_threads()) != 0:   # -1 arguments, -2 out of memory
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

    def _fused_table(self, cache):
        """(addresses [n_layers, width] int64, weight types [n_layers, 4] int32) for the C layer loop, per cache."""
        key = (cache.data.data_ptr(), cache.max_slots)
        got = self._fused_tables.get(key)
        if got is not None:
            return got

        got = fused_layer_table(self.layers, cache)
        if len(self._fused_tables) >= 8:   # engines make a few caches; never grow without bound
            self._fused_tables.clear()
        self._fused_tables[key] = got
        return got

    def _fused_flags(self, flags: list) -> torch.Tensor:
        if self._fused_fl[0] is not flags:
            self._fused_fl = (flags, torch.tensor(flags, dtype=torch.uint8))
        return self._fused_fl[1]
