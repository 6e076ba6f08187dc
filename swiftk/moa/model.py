"""The Mixture of Attentions (MoA) drafter: a small trained model that reads the target's own verified KV cache.

One draft step for a token at position p, when the target has verified positions [0, n) (n <= p):

  LSA  per verified position t: its target K/V of all L layers [L, 2*E_kv] -> attention across the layer axis
       (each position on its own, full mask) -> mean over layers -> [lsa_dim]. Computed once per verified token.
  SA   causal self-attention over the drafter's own token stream (verified tokens, then the draft chain).
  CA   queries from the draft token, keys/values from LSA of positions [0, n) plus a learned always-visible "sink"
       (so a query with nothing verified before it still has a defined softmax).
  ANC  (anchor=True) the target's final-normed hidden state at the last verified position n - 1, projected, plus an
       embedding of the depth k = p - n + 1: added to the row after SA (EAGLE's feature: the state that gave the
       root token; a row's own path only, so the SA keys of verified tokens stay token-only).
  MLP  then a projection to the target's hidden size: the activation entering target layer L - TLI.
  TLI = 0: that activation is the final residual (target's final norm + LM head give logits);
  TLI = N: the target's own last N layers (frozen, with their KV cache) finish the step.

Training (moa.train) is teacher-forced on a fixed corpus: the row for token i sees LSA only up to i - k, k >= 1
drawn per row, which mimics drafting k - 1 tokens past the last verified one ("T-step boundedness").
Shapes in comments: B batch, T tokens, L target layers, E = 2 * n_kv_heads * head_dim, d drafter width.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SwiftkError
from ..files import regular_file

FORMAT = "swiftk-moa-drafter/1"


@dataclass(frozen=True)
class MoAConfig:
    hidden: int          # target hidden size D
    n_layers: int        # target layers L
    kv_dim: int          # E = 2 * n_kv_heads * head_dim (one position's K and V in one target layer)
    vocab_size: int
    d: int = 256         # drafter width
    heads: int = 4
    mlp: int = 768
    lsa_dim: int = 128
    lsa_heads: int = 2
    tli: int = 0         # target layers that finish a draft step
    lsa: bool = True     # False: the ablation without layer self-attention (last target layer's K/V only)
    anchor: bool = False  # EAGLE's feature: the target's final hidden state at the last verified position
    max_offset: int = 8  # training: rows see verified states 1..max_offset positions back
    rope_theta: float = 10000.0

    def validate(self, target_cfg=None) -> "MoAConfig":
        for f in ("hidden", "n_layers", "kv_dim", "vocab_size", "d", "heads", "mlp", "lsa_dim", "lsa_heads",
                  "max_offset"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SwiftkError(f"drafter config: {f} must be a positive int, got {v!r}")
        if self.d % self.heads or (self.d // self.heads) % 2 or self.lsa_dim % self.lsa_heads:
            raise SwiftkError("drafter config: d must split into heads of even size, lsa_dim into lsa_heads")
        if isinstance(self.tli, bool) or not isinstance(self.tli, int) or not 0 <= self.tli < self.n_layers:
            raise SwiftkError(f"drafter config: tli must be in 0..{self.n_layers - 1}, got {self.tli!r}")
        if target_cfg is not None:
            c = target_cfg
            want = (c.hidden_size, c.n_layers, 2 * c.n_kv_heads * c.head_dim, c.vocab_size)
            have = (self.hidden, self.n_layers, self.kv_dim, self.vocab_size)
            if want != have:
                raise SwiftkError(f"drafter was trained for a target with (hidden, layers, kv_dim, vocab) = {have}, "
                                  f"this model has {want}")
        return self

    @staticmethod
    def for_target(cfg, **kw) -> "MoAConfig":
        return MoAConfig(hidden=cfg.hidden_size, n_layers=cfg.n_layers, kv_dim=2 * cfg.n_kv_heads * cfg.head_dim,
                         vocab_size=cfg.vocab_size, **kw).validate()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def rope_inv_freq(hd: int, theta: float) -> torch.Tensor:
    return theta ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)


def rope(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """x [..., T, h, hd] rotated by positions pos [..., T] (rotate-half convention, frequencies ``inv``)."""
    hd = x.shape[-1]
    ang = pos.to(torch.float32)[..., None] * inv                     # [..., T, hd/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[..., None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[..., None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class MoADrafter(nn.Module):
    def __init__(self, cfg: MoAConfig):
        super().__init__()
        self.cfg = cfg.validate()
        c, d = cfg, cfg.d
        # LSA: one attention layer across the target's layers, per position
        self.lsa_in = nn.Linear(c.kv_dim, c.lsa_dim)
        self.layer_emb = nn.Parameter(torch.zeros(c.n_layers, c.lsa_dim))
        self.lsa_norm = nn.Parameter(torch.ones(c.lsa_dim))
        self.lsa_qkv = nn.Linear(c.lsa_dim, 3 * c.lsa_dim, bias=False)
        self.lsa_out = nn.Linear(c.lsa_dim, c.lsa_dim, bias=False)
        # token stream
        self.tok_in = nn.Linear(c.hidden, d, bias=False)    # from the target's (frozen) token embedding
        self.sa_norm = nn.Parameter(torch.ones(d))
        self.sa_qkv = nn.Linear(d, 3 * d, bias=False)
        self.sa_out = nn.Linear(d, d, bias=False)
        self.ca_norm = nn.Parameter(torch.ones(d))
        self.ca_q = nn.Linear(d, d, bias=False)
        self.ca_kv = nn.Linear(c.lsa_dim, 2 * d, bias=False)
        self.ca_sink = nn.Parameter(torch.zeros(2, d))        # always-visible key/value
        self.ca_out = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.w_gate_up = nn.Linear(d, 2 * c.mlp, bias=False)
        self.w_down = nn.Linear(c.mlp, d, bias=False)
        self.out_norm = nn.Parameter(torch.ones(d))
        self.out = nn.Linear(d, c.hidden, bias=False)
        if c.anchor:
            self.anchor_in = nn.Linear(c.hidden, d, bias=False)
            self.depth_emb = nn.Parameter(torch.zeros(c.max_offset, d))
            nn.init.zeros_(self.anchor_in.weight)   # starts as the plain MoA drafter: the anchor only adds
        # RoPE frequencies of the drafter's heads: derived from the config, not stored in the file
        self.register_buffer("inv_freq", rope_inv_freq(d // c.heads, c.rope_theta), persistent=False)
        for m in (self.sa_out, self.ca_out, self.w_down, self.lsa_out):
            nn.init.zeros_(m.weight)   # every block starts as the identity on its residual stream

    # ---- LSA: target KV of verified positions -> cross-attention keys/values
    def lsa_features(self, kv: torch.Tensor) -> torch.Tensor:
        """kv [..., L, E] (one position's target K/V per layer) -> [..., lsa_dim]."""
        c = self.cfg
        if not c.lsa:
            return self.lsa_in(kv[..., -1, :])
        x = self.lsa_in(kv) + self.layer_emb                               # [..., L, a]
        shp = x.shape
        x = x.reshape(-1, c.n_layers, c.lsa_dim)
        q, k, v = self.lsa_qkv(rms(x, self.lsa_norm)).chunk(3, -1)
        hs = lambda t: t.view(t.shape[0], c.n_layers, c.lsa_heads, -1).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(hs(q), hs(k), hs(v))          # across layers, full mask
        x = x + self.lsa_out(o.transpose(1, 2).reshape(x.shape))
        return x.mean(1).reshape(shp[:-2] + (c.lsa_dim,))

    def ca_keys(self, feats: torch.Tensor, pos: torch.Tensor) -> tuple:
        """LSA features [..., S, a] at positions [..., S] -> (k, v) [..., S, heads, hd], k rotated."""
        c = self.cfg
        k, v = self.ca_kv(feats).chunk(2, -1)
        k = k.view(k.shape[:-1] + (c.heads, -1))
        return rope(k, pos, self.inv_freq), v.view(v.shape[:-1] + (c.heads, -1))

    # ---- token stream
    def sa_kv(self, emb: torch.Tensor, pos: torch.Tensor) -> tuple:
        """The drafter's own K/V for tokens (target embeddings [..., T, D]) -> (x, k, v); x is the residual."""
        c = self.cfg
        x = self.tok_in(emb)
        q, k, v = self.sa_qkv(rms(x, self.sa_norm)).chunk(3, -1)
        sh = lambda t: t.view(t.shape[:-1] + (c.heads, -1))  # noqa: E731
        return x, rope(sh(q), pos, self.inv_freq), rope(sh(k), pos, self.inv_freq), sh(v)

    def anchor(self, final: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """The anchor term of rows at depth ``depth`` [...] (>= 1) whose last verified position's final-normed
        hidden state is ``final`` [..., hidden] -> [..., d]. Depths past training's reuse its deepest embedding."""
        return self.anchor_base(final) + self.depth_emb[(depth - 1).clamp(0, self.cfg.max_offset - 1)]

    def anchor_base(self, final: torch.Tensor) -> torch.Tensor:
        """The anchor term less its depth embedding (what a chain's steps share)."""
        # unit RMS in: the target's final norm scales its output by weights far from 1
        return self.anchor_in(F.rms_norm(final, (final.shape[-1],), None, 1e-6))

    def finish(self, x: torch.Tensor, sa_o: torch.Tensor, ca_k, ca_v, ca_mask, pos, anchor=None) -> torch.Tensor:
        """After self-attention: residual add (and the anchor term), cross-attention to the LSA keys, MLP, output
        projection -> the predicted target activation [..., T, hidden]. ca_k/ca_v [..., S, h, hd] (sink excluded),
        ca_mask [..., T, S] bool."""
        c = self.cfg
        x = x + self.sa_out(sa_o)
        if anchor is not None:
            x = x + anchor
        q = rope(self.ca_q(rms(x, self.ca_norm)).view(x.shape[:-1] + (c.heads, -1)), pos, self.inv_freq)
        lead = ca_k.shape[:-3]
        sk = self.ca_sink[0].view(c.heads, -1).expand(lead + (1, c.heads, c.d // c.heads))
        sv = self.ca_sink[1].view(c.heads, -1).expand(lead + (1, c.heads, c.d // c.heads))
        k, v = torch.cat([sk, ca_k], -3), torch.cat([sv, ca_v], -3)
        m = torch.cat([torch.ones(ca_mask.shape[:-1] + (1,), dtype=torch.bool, device=ca_mask.device), ca_mask], -1)
        o = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                           attn_mask=m.unsqueeze(-3))
        x = x + self.ca_out(o.transpose(-3, -2).reshape(x.shape))
        g, u = self.w_gate_up(rms(x, self.mlp_norm)).chunk(2, -1)
        x = x + self.w_down(F.silu(g) * u)
        return self.out(rms(x, self.out_norm))

    def forward_train(self, emb, kv, offsets, final=None) -> torch.Tensor:
        """Teacher-forced pass over B chunks: emb [B, T, D] target embeddings of the tokens, kv [B, T, L, E] their
        target K/V, offsets [B, T] long >= 1 (row i sees LSA of positions <= i - offsets[i]), final [B, T, D] the
        target's final-normed hidden states (the anchor's input) -> [B, T, hidden]."""
        B, T = emb.shape[:2]
        pos = torch.arange(T, device=emb.device).expand(B, T)
        x, q, k, v = self.sa_kv(emb, pos)
        sa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        ck, cv = self.ca_keys(self.lsa_features(kv), pos)
        j = torch.arange(T, device=emb.device)
        mask = j[None, None, :] <= (j[None, :, None] - offsets[:, :, None])   # [B, T, T]
        anchor = None
        if self.cfg.anchor:
            last = j[None, :] - offsets                                          # [B, T]: the last verified position
            f = final.gather(1, last.clamp_min(0)[..., None].expand(-1, -1, final.shape[-1]))
            anchor = self.anchor(f * (last >= 0)[..., None], offsets)           # nothing verified yet: no feature
        return self.finish(x, sa.transpose(1, 2).reshape(B, T, -1), ck, cv, mask, pos, anchor)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ------------------------------------------------------------------------------------------- files
def save(path, drafter: MoADrafter, identity: dict, extra: dict = None) -> None:
    """safetensors file (float32 or bf16 tensors) with the config, the target's identity and ``extra`` in the
    metadata; written under a temporary name, then renamed."""
    from safetensors.torch import save_file   # lazy: safetensors, only where a drafter is written

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "config": json.dumps(asdict(drafter.cfg)),
            "target": json.dumps({k: identity.get(k) for k in ("fingerprint", "name")}),
            "extra": json.dumps(extra or {})}
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def load(path, target_cfg=None, identity: dict = None, device="cpu") -> tuple:
    """-> (MoADrafter in float32, extra dict). Rejects files that are not drafters, or a drafter for another
    target (by shape, and by fingerprint when both sides have one)."""
    from safetensors import SafetensorError, safe_open   # lazy: safetensors, only where a drafter is read

    path = Path(path)
    if not path.exists():
        raise SwiftkError(f"no drafter file at {path}")
    regular_file(path, "drafter file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise SwiftkError(f"{path} is not a swiftk MoA drafter (format {meta.get('format')!r})")
            names = {f.name for f in fields(MoAConfig)}
            raw = json.loads(meta["config"])
            cfg = MoAConfig(**{k: v for k, v in raw.items() if k in names})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            target = json.loads(meta.get("target", "{}"))
            extra = json.loads(meta.get("extra", "{}"))
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise SwiftkError(f"cannot read drafter {path}: {e}") from None
    cfg.validate(target_cfg)
    fp = (identity or {}).get("fingerprint")
    if fp and target.get("fingerprint") and fp != target["fingerprint"]:
        raise SwiftkError(f"drafter {path} was trained for model {target.get('name')!r} "
                          f"(fingerprint {target['fingerprint'][:12]}), not this one ({fp[:12]})")
    m = MoADrafter(cfg)
    try:
        m.load_state_dict({k: v.float() for k, v in tensors.items()})
    except RuntimeError as e:
        raise SwiftkError(f"drafter {path} has tensors that do not match its config: {e}") from None
    if not all(torch.isfinite(p).all() for p in m.parameters()):
        raise SwiftkError(f"drafter {path} has non-finite weights")
    return m.to(device).eval().requires_grad_(False), extra
