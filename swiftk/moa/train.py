"""Training the MoA drafter on cached target features (moa.data): forward KL from the target's next-token
distribution to the drafter's, plus Smooth-L1 between predicted and true activations.

TLI = 0: the prediction is the final hidden state; both sides' logits come from the target's final norm + LM head.
TLI = N: the prediction is the residual entering layer L - N; the target's last N layers (frozen) finish it,
attending to the chunk's true K/V for earlier positions (teacher forcing) and to the prediction's own K/V.
Each row draws an offset k >= 1 (P(k) ~ 0.7^(k-1), k <= max_offset): it sees the target's states only up to
k positions back, as a draft token k - 1 steps past the last verified one does.

Checkpoints (every ``ckpt_every`` steps and at the end) hold the drafter, AdamW's moments and the step in one
safetensors file (no pickle); ``resume`` continues from it with the same batch sequence (batches are drawn from
a generator seeded by (seed, step)).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import SwiftkError
from ..home import swiftk_home
from ..proposers.draft_head import frequent_token_ids
from ..runtime.ops import reference as R
from ..runtime.weights import BlockWeight, dense, linear
from ..target import Target
from .corpus import chunks as cut_chunks
from .data import batch_features
from .model import MoAConfig, MoADrafter, rms, save

EVAL_CHUNKS = 24   # held-out chunks the report's agreement is measured on
_LAYER_TENSORS = ("attn_norm", "wqkv", "bqkv", "wo", "mlp_norm", "w_gate_up", "w_down")


def offset_probs(K: int) -> torch.Tensor:
    p = torch.tensor([0.7 ** i for i in range(K)])
    return p / p.sum()


class Frozen:
    """The target pieces training needs, as plain float32 tensors (autograd flows through, never into them):
    block-format (GGUF) weights are de-quantized, so the drafter learns the numerical model it will draft for."""

    def __init__(self, model, tli: int, head_ids: torch.Tensor):
        c = model.cfg
        if model.dtype != torch.float32 or model.device.type != "cpu":
            raise SwiftkError("train the drafter on the CPU float32 target (dtype='float32', device='cpu')")
        self.model, self.cfg, self.tli = model, c, tli
        head = model.lm_head
        self.head = (head.rows(head_ids) if isinstance(head, BlockWeight) else dense(head[head_ids])).float()
        self.norm = model.norm.float().clone()
        self.layers = [{k: (None if v is None else dense(v).float().clone()) for k, v in vars(model.layers[i]).items()
                        if k in _LAYER_TENSORS}
                       for i in range(c.n_layers - tli, c.n_layers)]
        self.inv_freq = model.inv_freq.clone()

    def embed(self, tokens):
        return self.model.embed_rows(tokens.reshape(-1)).float().reshape(tokens.shape + (-1,))

    def logits(self, x):
        """The target's own logits over the whole vocabulary (its kernels: the greedy token it will emit)."""
        return linear(x.reshape(-1, x.shape[-1]).contiguous(), self.model.lm_head).reshape(x.shape[:-1] + (-1,))

    def finish(self, h, kv, layer0: int):
        """Residual h [B, T, D] entering layer ``layer0`` -> final-normed hidden, through the frozen last layers
        with the true K/V [B, T, L, E] of earlier positions and the prediction's own at its position."""
        c = self.cfg
        B, T, D = h.shape
        H, KV, hd = c.n_heads, c.n_kv_heads, c.head_dim
        pos = torch.arange(T, device=h.device)
        cos, sin = R.rope_tables(pos, self.inv_freq)                       # [T, 1, hd]
        eye = torch.eye(T, dtype=torch.bool, device=h.device)
        before = torch.ones(T, T, dtype=torch.bool, device=h.device).tril(-1)
        for i, L in enumerate(self.layers):
            li = layer0 + i
            x = rms(h, L["attn_norm"], c.rms_eps)
            qkv = x @ L["wqkv"].T
            if L["bqkv"] is not None:
                qkv = qkv + L["bqkv"]
            q = R.rope_with_tables(qkv[..., : H * hd].reshape(B, T, H, hd), cos, sin)
            k = R.rope_with_tables(qkv[..., H * hd:(H + KV) * hd].reshape(B, T, KV, hd), cos, sin)
            v = qkv[..., (H + KV) * hd:].reshape(B, T, KV, hd)
            kt = kv[:, :, li, : KV * hd].reshape(B, T, KV, hd).float()
            vt = kv[:, :, li, KV * hd:].reshape(B, T, KV, hd).float()
            rep = H // KV
            k, v, kt, vt = (t.repeat_interleave(rep, 2).transpose(1, 2) for t in (k, v, kt, vt))  # [B, H, T, hd]
            qh = q.transpose(1, 2)
            s = (qh @ kt.transpose(-1, -2)) * hd ** -0.5
            own = (qh * k).sum(-1) * hd ** -0.5                                # [B, H, T]
            s = torch.where(eye, own[..., None], s.masked_fill(~before, float("-inf")))
            p = torch.softmax(s, -1)
            o = p.masked_fill(eye, 0.0) @ vt + p.diagonal(dim1=-2, dim2=-1)[..., None] * v
            h = h + o.transpose(1, 2).reshape(B, T, H * hd) @ L["wo"].T
            x = rms(h, L["mlp_norm"], c.rms_eps)
            g, u = (x @ L["w_gate_up"].T).chunk(2, -1)
            h = h + (F.silu(g) * u) @ L["w_down"].T
        return rms(h, self.norm, c.rms_eps)


def _loss(drafter, frozen: Frozen, batch: dict, offsets, reg_weight: float, head: torch.Tensor) -> tuple:
    """-> (loss, kl, reg, predicted final-normed hidden, true final-normed hidden). The KL is over the rows of
    ``head`` (the draft vocabulary the drafter's logits are read from at generation), renormalized."""
    tli = drafter.cfg.tli
    emb = frozen.embed(batch["tokens"])
    kv = batch["kv"].float()
    target_x = batch["final"].float()
    pred = drafter.forward_train(emb, kv, offsets, target_x)
    if tli == 0:
        xhat = rms(pred, frozen.norm, frozen.cfg.rms_eps)
        reg = F.smooth_l1_loss(xhat, target_x)
    else:
        true = batch[f"resid{tli}"].float()
        scale = true.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-3)
        reg = F.smooth_l1_loss(pred / scale, true / scale)
        xhat = frozen.finish(pred, kv, frozen.cfg.n_layers - tli)
    with torch.no_grad():
        pt = torch.softmax(target_x @ head.T, -1)
    dl = xhat @ head.T
    kl = F.cross_entropy(dl.flatten(0, -2), pt.flatten(0, -2)) + (pt * pt.clamp_min(1e-30).log()).sum(-1).mean()
    return kl + reg_weight * reg, kl, reg, xhat, target_x


@torch.no_grad()
def evaluate(drafter, frozen: Frozen, feats: list, head_ids: torch.Tensor, max_depth: int = 4) -> dict:
    """Held-out estimate: how often the drafter's top-1 (over the draft vocabulary) is the target's top-1 (over
    the full vocabulary, by its own kernels) -- the greedy acceptance rate of a draft token -- per offset k (depth
    k - 1 past the last verified token), and the mean accepted length of a greedy chain of ``max_depth`` drafts
    implied by them (1 + a1 + a1*a2 + ...). ``feats``: one feature dict per held-out chunk."""
    drafter.eval()
    acc = []
    wants = [frozen.logits(b["final"]).argmax(-1) for b in feats]
    for k in range(1, max_depth + 1):
        hit = n = 0
        for b, want in zip(feats, wants):
            b1 = {name: t[None] for name, t in b.items()}
            off = torch.full(b1["tokens"].shape, k, dtype=torch.long)
            _, _, _, xhat, _ = _loss(drafter, frozen, b1, off, 0.0, frozen.head)
            mine = head_ids[(xhat[0] @ frozen.head.T).argmax(-1)]
            hit += int((mine == want)[k:].sum())   # rows that see at least one verified state
            n += mine.shape[0] - k
        acc.append(hit / max(n, 1))
    drafter.train()
    m, surv = 1.0, 1.0
    for a in acc:
        surv *= a
        m += surv
    return {"acceptance_by_depth": [round(a, 4) for a in acc], "mean_accepted_length": round(m, 3)}


def draw_offsets(probs: torch.Tensor, shape, seed: int, step: int) -> torch.Tensor:
    """Each row's offset k >= 1 for step ``step`` (seeded by it: a resumed run draws what it would have)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.multinomial(probs, math.prod(shape), replacement=True, generator=g).view(shape) + 1


def schedule(lr: float, step: int, steps: int) -> float:
    """Warm-up over 50 steps, then cosine to zero at ``steps``."""
    return lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))


def train_step(drafter, opt, frozen: Frozen, b: dict, offsets, lr: float, reg_weight: float) -> tuple:
    """One optimizer step on the features ``b`` -> (kl, reg) as tensors."""
    for grp in opt.param_groups:
        grp["lr"] = lr
    loss, kl, reg, _, _ = _loss(drafter, frozen, b, offsets, reg_weight, frozen.head)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    opt.step()
    return kl, reg


def _ckpt_tensors(drafter, opt) -> dict:
    out = {f"model.{k}": v.detach().clone() for k, v in drafter.state_dict().items()}
    names = {id(p): n for n, p in drafter.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                out[f"adam.m.{names[id(p)]}"] = st["exp_avg"]
                out[f"adam.v.{names[id(p)]}"] = st["exp_avg_sq"]
    return out


def _save_ckpt(path: Path, drafter, opt, step: int, meta: dict) -> None:
    from safetensors.torch import save_file   # lazy: safetensors, only for training checkpoints

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in _ckpt_tensors(drafter, opt).items()}, str(tmp),
                  metadata={"step": str(step), "meta": json.dumps(meta)})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _load_ckpt(path: Path, drafter, opt, meta: dict) -> int:
    from safetensors import SafetensorError, safe_open   # lazy: safetensors, only for training checkpoints

    try:
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
            same = json.loads(md["meta"]) == meta
            t = {k: f.get_tensor(k) for k in f.keys()}
        step = int(md["step"])
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise SwiftkError(f"cannot resume from checkpoint {path}: {e}; delete it or drop --resume") from None
    if not same:
        raise SwiftkError(f"checkpoint {path} was made with other settings; delete it or drop --resume")
    try:
        drafter.load_state_dict({k[6:]: v for k, v in t.items() if k.startswith("model.")})
    except RuntimeError as e:
        raise SwiftkError(f"checkpoint {path} does not fit this drafter: {e}") from None
    for n, p in drafter.named_parameters():
        if f"adam.m.{n}" in t:
            opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": t[f"adam.m.{n}"],
                            "exp_avg_sq": t[f"adam.v.{n}"]}
    return step


def train(target: Target, corpus: dict, out, *, steps: int = 1500, batch: int = 4, chunk: int = 384, lr: float = 2e-3,
          reg_weight: float = 1.0, vocab: int = 8192, seed: int = 0, resume: bool = False, ckpt_every: int = 100,
          reuse: int = 2, progress: bool = True, log=None, recipe: dict = None, **drafter_options) -> dict:
    """Train a drafter on ``corpus`` (moa.corpus.corpus: token ids, train and held-out), teacher-forced online: each
    ``reuse`` steps run the target over ``batch`` chunks of ``chunk`` tokens and train on their features (each
    step draws its own offsets; the target pass costs ~3x a drafter step, so a batch is reused). Writes the drafter
    to ``out`` (safetensors) with the report and ``recipe`` in its metadata. ``vocab``: the draft vocabulary (this
    many frequent tokens; the KL runs over them; 0 = the full vocabulary). Returns the report (held-out agreement
    by depth, time, sizes). ``progress``: a progress bar with its ETA; ``log``: else a callable given a line with
    the step, rate and ETA every 5% of the run (for a log file)."""
    for name, v in (("steps", steps), ("batch", batch), ("chunk", chunk), ("reuse", reuse), ("ckpt_every", ckpt_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SwiftkError(f"{name} must be a positive int, got {v!r}")
    torch.set_flush_denormal(True)   # softmax gradients underflow to denormals: 25x slower matmuls without this
    try:
        return _train(target, corpus, out, steps, batch, chunk, lr, reg_weight, vocab, seed, resume, ckpt_every,
                      reuse, progress, log, recipe or {}, drafter_options)
    finally:
        torch.set_flush_denormal(False)


def _batches(n_chunks: int, batch: int, seed: int, step: int) -> list:
    """The chunks of step ``step``: epochs of seeded permutations, so a resumed run draws what it would have."""
    per_epoch = max(1, n_chunks // batch)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n_chunks, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[i * batch:(i + 1) * batch].tolist()


def _train(target: Target, corpus, out, steps, batch, chunk, lr, reg_weight, vocab, seed, resume, ckpt_every, reuse, progress,
           log, recipe, drafter_options) -> dict:
    out = Path(out)
    train_rows, held_rows = cut_chunks(corpus["train"], chunk), cut_chunks(corpus["held_out"], chunk)[:EVAL_CHUNKS]
    if len(train_rows) < batch or len(held_rows) < 1:
        raise SwiftkError(f"corpus too small: {len(train_rows)} training and {len(held_rows)} held-out chunks of "
                          f"{chunk} tokens (need {batch} and 1); give more --tokens or --data")
    cfg = MoAConfig.for_target(target.config, **drafter_options)
    torch.manual_seed(seed)
    drafter = MoADrafter(cfg)
    V = target.config.vocab_size
    head_ids = (frequent_token_ids(target.tokenizer, vocab, cache_dir=swiftk_home() / "draft_vocab",
                                   model_name=target.name)
                if 0 < vocab < V else torch.arange(V))
    frozen = Frozen(target.model, cfg.tli, head_ids)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    meta = {"config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, "steps": steps, "batch": batch,
            "chunk": chunk, "reuse": reuse, "lr": lr, "reg_weight": reg_weight, "vocab": vocab, "seed": seed,
            "corpus": corpus["spec"]}
    ckpt = out.with_name(out.name + ".ckpt")
    step = start = _load_ckpt(ckpt, drafter, opt, meta) if resume and ckpt.is_file() else 0
    probs = offset_probs(cfg.max_offset)
    bar = None
    if progress:
        from tqdm import tqdm   # lazy: only for a progress bar (its rate and ETA)

        bar = tqdm(total=steps, initial=step, desc=f"train drafter (tli={cfg.tli}, {batch}x{chunk} tokens a step)",
                   unit="step")
    t0, history, t_target, b = time.perf_counter(), [], 0.0, None
    drafter.train()
    while step < steps:
        if b is None or step % reuse == 0:
            t = time.perf_counter()
            b = batch_features(target.model, train_rows[_batches(len(train_rows), batch, seed, step // reuse)], cfg.tli)
            t_target += time.perf_counter() - t
        offsets = draw_offsets(probs, b["tokens"].shape, seed, step)
        kl, reg = train_step(drafter, opt, frozen, b, offsets, schedule(lr, step, steps), reg_weight)
        step += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(kl=f"{kl.item():.3f}", reg=f"{reg.item():.3f}")
        if step == 1 or step % max(1, steps // 20) == 0:
            history.append((step, round(kl.item(), 4), round(reg.item(), 4)))
            if log is not None:
                el = time.perf_counter() - t0
                log(f"step {step}/{steps}: kl {kl.item():.3f}, {el / 60:.1f} min, "
                    f"ETA {el / (step - start) * (steps - step) / 60:.1f} min")
        if step % ckpt_every == 0 or step == steps:
            _save_ckpt(ckpt, drafter, opt, step, meta)
    if bar is not None:
        bar.close()
    train_s = time.perf_counter() - t0
    held = [{k: v[0] for k, v in batch_features(target.model, held_rows[i:i + 1], cfg.tli).items()}
            for i in range(len(held_rows))]
    report = {"held_out": evaluate(drafter, frozen, held, head_ids), "vocab": len(head_ids),
              "train_s": round(train_s, 1), "target_s": round(t_target, 1), "steps": steps, "batch": batch,
              "chunk_tokens": chunk, "train_tokens_seen": -(-steps // reuse) * batch * chunk,
              "corpus_train_tokens": len(train_rows) * chunk, "held_out_tokens": len(held_rows) * chunk,
              "parameters": drafter.n_params(), "history": history, "recipe": recipe}
    save(out, drafter, target.identity, report)
    return report
