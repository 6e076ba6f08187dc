"""CUDA graphs for the decode loop's small passes: plain steps, draft steps and verify passes.

A model this size decodes in well under a millisecond of GPU work on an H100, spread over ~15 kernels per layer;
eager PyTorch spends longer launching them than the GPU spends running them. A captured graph launches them all
at once. What a captured pass may not do is change shape or read anything on the host, so every pass served here
has this form:

    T new tokens at contiguous slots start .. start+T-1, each attending to every slot < start and to its
    ancestors among the new tokens (a plain or draft step: T = 1; a verify pass: the tree's ancestor matrix)

with the inputs copied into the graph's own buffers (token ids, positions, ``start``, the ancestor matrix) and the
attention mask built on the device from them. T is bucketed: up to 1, 2, 4, ... 64 (padding rows attend only to
themselves and write KV into scratch slots past the tree, which nothing reads). The mask spans the whole cache and
attention stops reading keys at ``start + T`` on the device (``ops.masks.BoundedMask``), so one graph serves every
cache length: a capture costs ~15 decode steps, and bucketing by length too made a 256-token answer capture a
dozen graphs. The plain graphs (every T, no skip set) are captured up front (``warm``) so that no decode pass pays
a capture. The host-side branching on the skip set (a skipped sublayer launches nothing) is frozen into a graph,
so a graph is captured per skip set: the optimizer changes the set rarely, and graphs are bounded in number
(least recently used evicted).

Anything else (prefill, a KVQ exit, partial passes, a cache too small for the padded bucket) runs eagerly;
``stats`` counts captures, replays and eager passes with their reasons.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Optional

import torch

from ..errors import warn
from .ops.masks import BoundedMask

T_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_GRAPHS = 48


def _bucket_T(T: int) -> Optional[int]:
    return next((b for b in T_BUCKETS if b >= T), None)


class _Graph:
    """One captured pass: its input buffers, the graph and its outputs (views into the graph's memory pool)."""

    def __init__(self, model, cache, Tb: int, skip, with_logits: bool):
        dev = model.device
        self.model, self.cache, self.skip, self.with_logits = model, cache, skip, with_logits
        self.tokens = torch.zeros(Tb, dtype=torch.long, device=dev)
        self.positions = torch.zeros(Tb, dtype=torch.long, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)
        self.eye = torch.eye(Tb, dtype=torch.bool, device=dev)
        self.anc = self.eye.clone()
        self.ar_T = torch.arange(Tb, device=dev)
        self.ar_S = torch.arange(cache.max_slots, device=dev)
        self.graph = None

    def _run(self):
        m, Tb, Sb = self.model, self.tokens.shape[0], self.ar_S.shape[0]
        slots = self.start + self.ar_T                                             # [Tb]
        mask = (self.ar_S[None, :] < self.start).expand(Tb, Sb).contiguous()       # committed prefix: all visible
        mask.scatter_(1, slots[None, :].expand(Tb, Tb), self.anc)                  # + ancestors among the new
        visible = BoundedMask(mask, self.start + Tb)
        h, x, _ = m.run_layers(m.embed_rows(self.tokens), 0, m.cfg.n_layers, self.positions, slots, self.cache,
                               visible, self.skip)
        if x is None:
            x = m.ops.rmsnorm(h, m.norm, m.cfg.rms_eps)
        return x, (m.final_logits(h, x, None, None) if self.with_logits else None)

    def fill(self, token_ids, positions, start: int, anc) -> None:
        T, Tb = token_ids.shape[0], self.tokens.shape[0]
        self.tokens[:T].copy_(token_ids, non_blocking=True)
        self.positions[:T].copy_(positions, non_blocking=True)
        if T < Tb:
            self.tokens[T:].zero_()
            self.positions[T:].fill_(start)
        self.start.fill_(start)
        if anc is not None:      # None: T == 1, a step sees the prefix and itself (anc stays [[True]])
            self.anc.copy_(self.eye)
            self.anc[:T, :T].copy_(anc, non_blocking=True)

    def capture(self, pool) -> None:
        """Warm up on a side stream (lazy inits, Triton compilation, cuBLAS workspaces) as torch asks, then capture.
        The warm-up runs on the filled inputs, so the KV it writes is the pass's own."""
        dev = self.model.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), torch.inference_mode():
            self._run()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            self.x, self.logits = self._run()
        self.graph = graph


class GraphRunner:
    """Serves eligible passes of one model from captured graphs (see the module docstring)."""

    def __init__(self, model, max_graphs: int = MAX_GRAPHS):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.max_graphs = max_graphs
        self._graphs: "OrderedDict[tuple, _Graph]" = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle()
        self.stats = {"captured": 0, "replayed": 0, "evicted": 0, "eager": Counter(), "capture_failed": None}

    def forward(self, token_ids, positions, start: int, anc, cache, skip, head):
        """Logits [T, V] (float32, a fresh tensor) for a pass of the form above, or None to run it eagerly."""
        T = token_ids.shape[0]
        Tb = _bucket_T(T)
        if Tb is None:
            return self._eager("tokens > %d" % T_BUCKETS[-1])
        if start + Tb > cache.max_slots:
            return self._eager("padded bucket past the cache end")
        g = self._graph(cache, Tb, skip, head is None, token_ids, positions, start, anc)
        if g is None:
            return None
        g.graph.replay()
        self.stats["replayed"] += 1
        if head is None:
            return g.logits[:T].clone()
        return head(g.x[:T])

    def warm(self, cache) -> None:
        """Capture the plain passes' graphs (every T bucket, no skip set) now, outside any timed decode pass. The
        warm-up passes write KV into slots [0, 32) of ``cache``, which a prefill overwrites."""
        for Tb in T_BUCKETS:
            if Tb <= cache.max_slots:
                ids = torch.zeros(Tb, dtype=torch.long, device=self.model.device)
                anc = None if Tb == 1 else torch.ones(Tb, Tb, dtype=torch.bool, device=ids.device).tril()
                self._graph(cache, Tb, None, True, ids, ids, 0, anc)

    def _graph(self, cache, Tb: int, skip, with_logits: bool, token_ids, positions, start: int, anc):
        """The graph of this form with its inputs filled, captured first if new; None if capture failed."""
        skip_key = None if skip is None else tuple(self.model.skip_flags(skip))
        key = (id(cache), cache.data.data_ptr(), tuple(cache.data.shape), Tb, skip_key, with_logits)
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            g.fill(token_ids, positions, start, anc)
            return g
        if self.stats["capture_failed"] is not None:
            return self._eager("capture failed earlier")
        g = _Graph(self.model, cache, Tb, skip, with_logits)
        g.fill(token_ids, positions, start, anc)
        try:
            g.capture(self._pool)
        except Exception as e:  # a kernel that cannot be captured: stay eager, say why once
            self.stats["capture_failed"] = f"{type(e).__name__}: {e}"
            warn(f"swiftk: CUDA graph capture failed, decoding eagerly ({self.stats['capture_failed']})",
                 RuntimeWarning)
            return None
        self.stats["captured"] += 1
        self._graphs[key] = g
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats["evicted"] += 1
        return g

    def _eager(self, why: str):
        self.stats["eager"][why] += 1
        return None

    def info(self) -> dict:
        return {"graphs": len(self._graphs), "captured": self.stats["captured"], "replayed": self.stats["replayed"],
                "evicted": self.stats["evicted"], "eager": dict(self.stats["eager"]),
                "capture_failed": self.stats["capture_failed"]}
