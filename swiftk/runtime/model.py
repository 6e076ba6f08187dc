"""The LLaMA-family runtime: one forward pass, top to bottom (weight formats: weights.py; the cache: kvcache.py).

``Model.forward(token_ids, positions, slots, cache, attn_mask=None, skip=None, logits_idx=None)``

* positions drive RoPE, slots say where each token's K/V is written; tree siblings share a position but own slots.
* ``attn_mask`` is ``None`` (causal over slot index), a dense bool ``[T, S]`` mask over the first S cache slots (or
  a :class:`~swiftk.runtime.ops.masks.BoundedMask`: the same with a device-side key bound), or a
  :class:`~swiftk.runtime.ops.masks.TreeMask` (all committed slots visible + the ancestor relation over the new tokens, which
  must then sit at slots ``prefix_len .. prefix_len+T-1``).
* ``skip`` is a bool ``[2 * n_layers]`` skip set (attention, MLP per layer): a skipped sublayer adds nothing to the
  residual stream. This is how the SWIFT draft model is the target model itself.
* Logits are computed only for the rows in ``logits_idx`` (default: all), by ``head`` when given (a reduced-
  vocabulary draft head) else the full LM head.

Partial passes (the KVQ cache) wrap the same layer loop: :meth:`Model.forward_to`, :meth:`Model.forward_from`,
``forward(..., capture_layer=E)``. The KV cache is written by slot; nothing here copies it. ``forward_batch``: the
rows of several sequences (:class:`Rows`, each with its own cache) in one pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .config import ModelConfig, rope_inv_freq
from .devices import check_device_dtype, resolve_device, resolve_dtype  # noqa: F401 (re-exported)
from ..errors import SwiftkError, warn
from .ops import cpu_layers, cpu_linear, cpu_quant, get_ops, native
from .ops import reference as reference_ops
from .graphs import GraphRunner
from .kvcache import KVCache, kv_dtype
from .skipset import SkipSet
from .ops.masks import BoundedMask, TreeMask
from .weights import (KERNEL_MAX_ROWS, WEIGHT_FORMATS, BlockWeight, QWeight, _TRANSPOSED,  # noqa: F401
                      choose_cpu_linear_forms, formats, fused_layer_table, linear, named_weights, nbytes)

# Rows of one fused pass over several sequences (forward_batch): each row is computed on its own, so any count is
# exact; more rows run as several passes (each reads the weights once more).
BATCH_MAX_ROWS = 256


def kv_type(cache) -> int:
    """The C loop's code of the cache's element type (csrc/include/swiftk_cpu.h SWK_KV_*)."""
    return {torch.float32: 0, torch.float16: 1}[cache.data.dtype]


@dataclass
class Rows:
    """One sequence's rows in a batched pass (:meth:`Model.forward_batch`): ``forward``'s arguments for it."""
    tokens: torch.Tensor                        # [n] token ids
    positions: torch.Tensor                     # [n]
    slots: torch.Tensor                         # [n] slots of ``cache``
    cache: KVCache
    mask: object = None                         # None (causal by slot), a TreeMask or a dense bool [n, S]
    logits_idx: Optional[torch.Tensor] = None   # the rows whose logits are wanted (None: all)


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor          # [(H + 2*KV) * hd, D]: one matmul for q, k and v
    bqkv: Optional[torch.Tensor]
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor     # [2I, D] = [gate; up]
    w_down: torch.Tensor


def _check_formats(weights: Optional[str], activations: Optional[str], device: torch.device, dtype) -> Optional[str]:
    """The activations' format of a model with these weights (None: the compute dtype's), or a SwiftkError for a
    combination that does not exist."""
    if weights is not None:
        if weights not in WEIGHT_FORMATS:
            raise SwiftkError(f"weights={weights!r}: use one of {', '.join(WEIGHT_FORMATS)} (or None)")
        if device.type != "cpu" or dtype != torch.float32:
            raise SwiftkError(f"weights={weights!r} is a CPU format with float32 activations; got device "
                              f"{device}, dtype {dtype}")
    if activations is not None and weights != "native":
        raise SwiftkError(f"activations={activations!r} applies to GGUF block weights (weights='native') only; "
                          f"these weights are {weights or 'float'}")
    if weights == "native":
        if activations is None:
            activations = cpu_quant.ACTIVATIONS[0]
        if activations not in cpu_quant.ACTIVATIONS:
            raise SwiftkError(f"activations={activations!r}: use one of {', '.join(cpu_quant.ACTIVATIONS)}")
    return activations


class Model:
    def __init__(self, cfg: ModelConfig, tensors: dict, device="cpu", dtype=torch.float32,
                 weights: Optional[str] = None, activations: Optional[str] = None, kv_cache: Optional[str] = None):
        """``weights``: None (every weight in ``dtype``), or a compressed format for the matrices (projections and
        LM head) with float32 activations, CPU only: "bfloat16" (half the bytes) or "int8" (per-row symmetric,
        a quarter). Either is a different target model than the float32 weights (rounded), and speculative
        decoding is lossless with respect to whichever runs. "native": ``tensors`` holds the GGUF file's
        block-format matrices as weights.BlockWeight (loaders.load_checkpoint(native=True)), used as they are.
        ``activations`` (native weights only): "int8" (default: each activation row quantized to int8 per block
        and multiplied in integers, the arithmetic of llama.cpp; kernels/cpu/cpu_qdot.cpp) or "float32" (the exact
        de-quantized model; kernels/cpu/cpu_quant.cpp). The two are slightly different numerical models; decoding is
        lossless with respect to the one that runs. ``kv_cache``: the cache's element type (kvcache.KV_FORMATS)."""
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype(kv_cache, self.device, dtype)
        self.weights = weights
        self.activations = _check_formats(weights, activations, self.device, dtype)   # None: compute dtype's
        self._arithmetic: dict = {}      # arithmetic()'s answers
        blocks = any(isinstance(t, BlockWeight) for t in tensors.values())
        if blocks != (weights == "native"):
            raise SwiftkError('weights="native" needs the tensors of loaders.load_checkpoint(path, native=True) '
                              "(GGUF block formats), and only it takes them")
        self._take_weights(tensors)
        # float32 angles like HF; inv_freq itself is computed in float64 then rounded.
        self.inv_freq = rope_inv_freq(cfg, device=self.device).float()
        self.scale = cfg.head_dim ** -0.5
        self.ops = get_ops(self.device)
        self._flags = (None, None)   # (skip-set tensor, its host list): read once per set
        self._no_skip = [False] * cfg.n_sublayers
        self.graphs = None           # graphs.GraphRunner on CUDA (enable_graphs); None: every pass eager
        # CPU float32 activations: the layer loop can run as one C call (kernels/cpu/cpu_decode.cpp) when the kernel
        # library is built; _fused_tables: per KV cache, the weight/cache addresses it reads
        self.fused_ok = (self.device.type == "cpu" and dtype == torch.float32
                          and all(t.dtype == torch.float32 for L in self.layers for t in (L.attn_norm, L.mlp_norm)))
        self._fused_tables: dict = {}
        self._fused_fl = (None, None)
        self._rope_table = None   # (cos, sin) [positions, hd/2] of the fused loop
        if self.device.type == "cpu" and not _TRANSPOSED and not native.active() and weights is None:
            with torch.inference_mode():
                choose_cpu_linear_forms(self.layers[0].w_gate_up)
        if weights == "native":
            if not cpu_quant.available():
                raise SwiftkError(f'weights="native" needs the CPU block kernel: {cpu_quant.status()}')
            if not native.active():
                self.fused_ok = False
        elif weights is not None and not native.active():
            warn(f"swiftk: weights={weights!r} without the CPU kernel ({cpu_linear.status()}) runs the "
                 "matmuls through torch after converting the weights every call: slow", RuntimeWarning)

    def _take_weights(self, tensors: dict) -> None:
        """The embedding, the norms, the LM head and the layers from a checkpoint's tensors (shapes checked), the
        matrices in the weight format asked for: q/k/v and gate/up fused into one matrix each."""
        weights, activations, dtype = self.weights, self.activations, self.dtype

        def matrix(t):
            if isinstance(t, BlockWeight):
                return t.with_act(activations)
            if weights == "int8":
                return QWeight.quantize(t)
            return t.to(torch.bfloat16).contiguous() if weights == "bfloat16" else t

        def get(name, shape):
            t = tensors.get(name)
            if t is None:
                raise SwiftkError(f"checkpoint is missing tensor {name!r}")
            if tuple(t.shape) != tuple(shape):
                raise SwiftkError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
            return t if isinstance(t, BlockWeight) else t.to(device=self.device, dtype=dtype).contiguous()

        def stack(ts):   # one matrix from row groups (q, k, v; gate, up) in whatever formats they came
            if all(isinstance(t, BlockWeight) for t in ts):
                return BlockWeight.cat(ts)
            return torch.cat([t.dequantize() if isinstance(t, BlockWeight) else t for t in ts])

        c = self.cfg
        D, hd, H, KV, I = c.hidden_size, c.head_dim, c.n_heads, c.n_kv_heads, c.intermediate_size
        self.embed = get("model.embed_tokens.weight", (c.vocab_size, D))
        self.norm = get("model.norm.weight", (D,))
        self.lm_head = matrix(self.embed if c.tie_embeddings else get("lm_head.weight", (c.vocab_size, D)))
        if c.tie_embeddings and isinstance(self.lm_head, BlockWeight):
            self.embed = self.lm_head   # one copy of the tied matrix (rows() reads packed blocks too)
        self.layers = []
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            q = get(p + "self_attn.q_proj.weight", (H * hd, D))
            k = get(p + "self_attn.k_proj.weight", (KV * hd, D))
            v = get(p + "self_attn.v_proj.weight", (KV * hd, D))
            bqkv = None
            if c.qkv_bias:
                bqkv = torch.cat([get(p + f"self_attn.{n}_proj.bias", (m * hd,)) for n, m in (("q", H), ("k", KV), ("v", KV))])
            self.layers.append(Layer(
                attn_norm=get(p + "input_layernorm.weight", (D,)),
                wqkv=matrix(stack([q, k, v])),
                bqkv=bqkv,
                wo=matrix(get(p + "self_attn.o_proj.weight", (D, H * hd))),
                mlp_norm=get(p + "post_attention_layernorm.weight", (D,)),
                w_gate_up=matrix(stack([get(p + "mlp.gate_proj.weight", (I, D)),
                                        get(p + "mlp.up_proj.weight", (I, D))])),
                w_down=matrix(get(p + "mlp.down_proj.weight", (D, I))),
            ))

    def enable_graphs(self, cache: Optional[KVCache] = None) -> None:
        """Replay the decode loop's small passes from CUDA graphs (graphs.py); those of plain passes over ``cache``
        are captured now, the rest on first use."""
        self.graphs = GraphRunner(self)
        if cache is not None:
            self.graphs.warm(cache)

    def new_cache(self, max_slots: int) -> KVCache:
        return KVCache(self.cfg, max_slots, self.kv_dtype, self.device, self.ops)

    def _layer_tensors(self):
        for L in self.layers:
            yield from (L.attn_norm, L.wqkv, L.wo, L.mlp_norm, L.w_gate_up, L.w_down)
            if L.bqkv is not None:
                yield L.bqkv

    def n_params(self) -> int:
        n = self.embed.numel() + self.norm.numel() + (0 if self.cfg.tie_embeddings else self.lm_head.numel())
        return n + sum(t.numel() for t in self._layer_tensors())

    def weight_bytes(self) -> int:
        """Bytes read per decode step (every layer weight, the final norm and the LM head once; the embedding
        only by row); the roofline denominator."""
        return nbytes(self.lm_head) + nbytes(self.norm) + sum(nbytes(t) for t in self._layer_tensors())

    def resident_bytes(self) -> int:
        """Bytes the weights occupy in memory (the embedding included; a tied head counted once)."""
        return sum(nbytes(t) for _, t in named_weights(self))

    def arithmetic(self, short: bool = False) -> str:
        """Which numerical model runs: the weight storage and the activation arithmetic of its matmuls. Kept per
        (short, weights, activations): every generate reports it, and walking the weights' formats took ~0.5 ms."""
        key = (short, self.weights, self.activations)
        if key not in self._arithmetic:
            kv = "" if self.kv_dtype == self.dtype else f", {str(self.kv_dtype)[6:]} KV cache"
            self._arithmetic[key] = self._describe(short) + kv
        return self._arithmetic[key]

    def _describe(self, short: bool) -> str:
        dt = str(self.dtype).replace("torch.", "")
        if self.weights == "native":
            kinds = sorted({f for fs in self.formats().values() for f in fs if f not in ("F32", "F16", "BF16")})
            what = f"{'/'.join(kinds)} blocks x {self.activations} activations"
            if short:
                return what
            kernel = (f"integer dot products, kernels/cpu/cpu_qdot.cpp {cpu_quant.int_isa()}" if self.activations == "int8"
                      else "de-quantized in registers, float32 FMAs, kernels/cpu/cpu_quant.cpp")
            return f"{what} ({kernel})"
        if self.weights is not None:
            return f"{self.weights} weights x float32 activations"
        return f"{dt} weights x {dt} activations"

    def formats(self) -> dict:
        """Storage format per kind of weight (weights.formats)."""
        return formats(self)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, token_ids, positions, slots, cache: KVCache, attn_mask=None, skip=None, logits_idx=None, *,
                head=None, capture_layer: Optional[int] = None, start: Optional[int] = None):
        """Logits [T (or len(logits_idx)), vocab] float32 for T new tokens at ``positions``, KV written at ``slots``.

        ``capture_layer=E`` also returns the residual entering layer E: (logits, h) (the KVQ exit state).
        ``start``: the host's copy of the slot of a single causal token (``slots == [start]``), so the pass needs no
        read-back of ``slots`` and a CUDA graph can serve it."""
        if start is not None and token_ids.shape[0] != 1:
            raise SwiftkError(f"start= describes a single token's slot, got {token_ids.shape[0]} tokens")
        if self.graphs is not None and logits_idx is None and capture_layer is None:
            # (first slot, ancestor matrix) of a pass of the form graphs.py replays; anything else runs eagerly
            form = None
            if isinstance(attn_mask, TreeMask) and attn_mask.ancestors is not None:
                form = (attn_mask.prefix_len, attn_mask.ancestors)
            elif attn_mask is None and start is not None:
                form = (start, None)
            if form is not None:
                out = self.graphs.forward(token_ids, positions, *form, cache, skip, head)
                if out is not None:
                    return out
        if attn_mask is None and start is not None:
            attn_mask = torch.ones(1, start + 1, dtype=torch.bool, device=self.device)   # every slot <= start
        h = self.embed_rows(token_ids)                                 # residual stream [T, D]
        h, x, captured = self.run_layers(h, 0, self.cfg.n_layers, positions, slots, cache, attn_mask, skip,
                                      capture_layer)
        logits = self.final_logits(h, x, logits_idx, head)
        return logits if capture_layer is None else (logits, captured)

    @torch.inference_mode()
    def forward_batch(self, parts: list) -> list:
        """Logits per part (a :class:`Rows`), each what ``forward`` gives for that part alone. On the CPU's fused
        loop one pass reads every weight once for all parts and computes each row on its own, so a row's bits do not
        depend on what shares the pass (batch invariance across sequences); elsewhere the parts run one after
        another."""
        if len({id(p.cache) for p in parts}) != len(parts):
            raise SwiftkError("forward_batch: every part needs a cache of its own")
        if (len(parts) > 1 and self.fused_ok and self.graphs is None and cpu_layers.fused_active()
                and all(p.tokens.shape[0] >= 1 for p in parts)):
            return self._forward_fused_batch(parts)
        return [self.forward(p.tokens, p.positions, p.slots, p.cache, attn_mask=p.mask, logits_idx=p.logits_idx)
                for p in parts]

    @torch.inference_mode()
    def forward_to(self, stop_layer: int, token_ids, positions, slots, cache: KVCache, attn_mask=None):
        """Layers [0, stop_layer) only: the residual stream [T, D] entering ``stop_layer``."""
        return self.run_layers(self.embed_rows(token_ids), 0, stop_layer, positions, slots, cache, attn_mask, None)[0]

    def embed_rows(self, token_ids) -> torch.Tensor:
        """The embedding rows of ``token_ids`` [T] -> [T, D] (a block-format embedding dequantizes just these)."""
        return self.embed.rows(token_ids) if isinstance(self.embed, BlockWeight) else self.embed[token_ids]

    @torch.inference_mode()
    def forward_from(self, start_layer: int, hidden, positions, slots, cache: KVCache, attn_mask=None, *,
                     head=None):
        """Layers [start_layer, L) from residual ``hidden`` [T, D] entering ``start_layer``; returns logits."""
        h, x, _ = self.run_layers(hidden, start_layer, self.cfg.n_layers, positions, slots, cache, attn_mask, None)
        return self.final_logits(h, x, None, head)

    @torch.inference_mode()
    def logits_of(self, hidden, head=None):
        """Logits of a final residual [T, D] (final norm, then ``head`` or the LM head)."""
        return self.final_logits(hidden, None, None, head)

    def run_layers(self, h, start: int, stop: int, positions, slots, cache, attn_mask, skip, capture=None):
        """The layer loop over residual ``h`` for layers [start, stop). Returns (h, x, captured): x is h normed
        for whatever comes next when the loop ran to the end, else None."""
        c, ops = self.cfg, self.ops
        T = h.shape[0]
        H, KV, hd, n_layers = c.n_heads, c.n_kv_heads, c.head_dim, c.n_layers
        if not 0 <= start <= stop <= n_layers:
            raise SwiftkError(f"bad partial pass: layers [{start}, {stop}) of {n_layers}")
        flags = self.skip_flags(skip)
        end = stop
        if stop == n_layers:
            # Past the last computed sublayer the residual no longer changes: stop there (an early-exit draft reads
            # no weight of the layers it skips).
            last = max((i for i in range(2 * start, 2 * stop) if not flags[i]), default=-1)
            end = last // 2 + 1
        if self.fused_ok and h.dtype == torch.float32 and cpu_layers.fused_active():
            if T <= KERNEL_MAX_ROWS:
                return self._layers_fused(h, start, end, stop, positions, slots, cache, attn_mask, flags, capture)
            if attn_mask is None and bool((slots[1:] > slots[:-1]).all()):   # a causal prefill, in order
                return self._layers_fused_chunks(h, start, end, stop, positions, slots, cache, flags, capture)
        attend = self._attention(T, slots, cache, attn_mask)   # the op-by-op path's (the fused loop does its own)
        rope = ops.rope_plan(positions, self.inv_freq)
        captured = h.clone() if capture == start else None
        x = None   # h normed with the weight of the next sublayer, when the fused add+norm already produced it
        for li in range(start, end):
            L = self.layers[li]
            if li == capture and li > start:
                captured = h.clone()
            if not flags[2 * li]:
                if x is None:
                    x = ops.rmsnorm(h, L.attn_norm, c.rms_eps)
                qkv = linear(x, L.wqkv)
                if L.bqkv is not None:
                    qkv = qkv + L.bqkv
                qk = rope(qkv[:, :(H + KV) * hd].view(T, H + KV, hd))   # q and k heads rotated together
                q, k = qk[:, :H], qk[:, H:]
                kv = cache.data[li]
                kv[0, :, slots] = k.transpose(0, 1).to(kv.dtype)
                kv[1, :, slots] = qkv[:, (H + KV) * hd:].view(T, KV, hd).transpose(0, 1).to(kv.dtype)
                o = linear(attend(q, kv), L.wo)
                x, h = ops.fused_add_rmsnorm(o.reshape(T, -1), h, L.mlp_norm, c.rms_eps)
            elif not flags[2 * li + 1]:
                x = ops.rmsnorm(h, L.mlp_norm, c.rms_eps)
            nxt_norm = self.layers[li + 1].attn_norm if li + 1 < n_layers else self.norm
            if not flags[2 * li + 1]:
                m = linear(ops.swiglu(linear(x, L.w_gate_up)), L.w_down)
                x, h = ops.fused_add_rmsnorm(m, h, nxt_norm, c.rms_eps)
            else:
                x = None
        if capture is not None and captured is None:
            captured = h  # every sublayer from ``capture`` on was skipped: h is its input
        return h, (x if end == n_layers else None), captured

    def final_logits(self, h, x, logits_idx, head):
        if x is None:
            x = self.ops.rmsnorm(h, self.norm, self.cfg.rms_eps)
        if logits_idx is not None:
            x = x[logits_idx]
        return head(x) if head is not None else linear(x, self.lm_head).float()

    def skip_flags(self, skip) -> list:
        """The host flags of a skip set (a skipset.SkipSet carries its own; a bool tensor [2L] is read once)."""
        n = self.cfg.n_sublayers
        if skip is None:
            return self._no_skip
        if isinstance(skip, SkipSet):
            return skip.flags
        if self._flags[0] is skip:
            return self._flags[1]
        if not isinstance(skip, torch.Tensor) or skip.dtype != torch.bool or tuple(skip.shape) != (n,):
            raise SwiftkError(f"skip set must be a bool tensor of shape [{n}] (attention, MLP per layer)")
        # The torch path branches on the host (read once per skip-set tensor); kernels read it on device.
        self._flags = (skip, skip.tolist())
        return self._flags[1]

    def _attention(self, T, slots, cache, attn_mask):
        """The attention call for this pass: f(q, kv_layer) -> [T, H*hd]."""
        ops, scale = self.ops, self.scale
        if isinstance(attn_mask, TreeMask):
            self._check_tree_fits(attn_mask, T, cache)
            return ops.tree_attend(attn_mask, T, scale)
        if isinstance(attn_mask, BoundedMask):
            S, mask = self._visibility(T, slots, cache, attn_mask.mask)
            lim = attn_mask.limit
            return lambda q, kv: ops.attention(q, kv[0, :, :S], kv[1, :, :S], mask, scale, limit=lim).reshape(T, -1)
        S, mask = self._visibility(T, slots, cache, attn_mask)
        return lambda q, kv: ops.attention(q, kv[0, :, :S], kv[1, :, :S], mask, scale).reshape(T, -1)

    @staticmethod
    def _check_tree_fits(mask: TreeMask, T: int, cache) -> None:
        if mask.prefix_len + T > cache.max_slots:
            raise SwiftkError(f"tree of {T} tokens after {mask.prefix_len} committed exceeds the cache "
                              f"({cache.max_slots} slots)")

    def _visibility(self, T, slots, cache, attn_mask) -> tuple:
        """(S, mask [T, S] bool) of a pass without a tree: causal by slot when ``attn_mask`` is None, else it."""
        if attn_mask is None:
            S = int(slots.max()) + 1
            if S > cache.max_slots:
                raise SwiftkError(f"slot {S - 1} is outside the cache ({cache.max_slots} slots)")
            return S, torch.arange(S, device=self.device)[None, :] <= slots[:, None]
        if attn_mask.dtype != torch.bool or attn_mask.dim() != 2 or attn_mask.shape[0] != T:
            raise SwiftkError(f"attn_mask must be a bool tensor [T={T}, S], got {tuple(attn_mask.shape)} "
                              f"{attn_mask.dtype}")
        S = attn_mask.shape[1]
        if S > cache.max_slots:
            raise SwiftkError(f"attn_mask covers {S} slots but the cache has {cache.max_slots}")
        return S, attn_mask

    # ------------------------------------------------------------------ the CPU fast path of run_layers
    # Whole runs of layers in one C call (kernels/cpu/cpu_decode.cpp), with the per-cache address tables it reads.

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
        would write; and the loop's attention and elementwise ops beat torch's at prefill sizes (bench/results/history.md)."""
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
