"""Drafter architectures compared on one budget: every arm trains on the same target passes, in the same order,
with the same offsets and schedule; then each is scored on the same held-out chunks.

    python -m bench.drafter_arch --model smollm2-135m --arm moa= --arm anchor=anchor --steps 150

An arm is LABEL=OPTIONS, OPTIONS a comma list of MoAConfig fields: ``anchor`` (EAGLE's feature: the target's
final hidden state at the last verified position), ``no-lsa`` (the last target layer's K/V instead of layer
self-attention), ``d=N``, ``mlp=N``, ``tli=N``. The text is train-drafter's default corpus (``--tokens``).
Reports held-out greedy agreement by depth 1-4 (train.evaluate), parameters and seconds of training per arm.
Writes ``bench/results/drafter_arch_<model>_<date>.json``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path


def _options(text: str) -> dict:
    out = {}
    for o in filter(None, text.split(",")):
        if o == "anchor":
            out["anchor"] = True
        elif o == "no-lsa":
            out["lsa"] = False
        else:
            k, sep, v = o.partition("=")
            if not sep or k not in ("d", "mlp", "tli", "heads", "lsa_dim"):
                raise SystemExit(f"unknown arm option {o!r}")
            out[k] = int(v)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.drafter_arch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--arm", action="append", required=True, metavar="LABEL=OPTIONS")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="corpus size (as train-drafter's --tokens)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=384)
    ap.add_argument("--reuse", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--chunks", type=int, default=24, help="held-out chunks")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    arms = {lb: _options(o) for lb, _, o in (x.partition("=") for x in a.arm)}

    import torch
    import swiftk
    from benchlib.machine import machine_info
    from swiftk.atomic import write_json_atomic
    from swiftk.moa import corpus as C, data as D, train as T
    from swiftk.moa.model import MoAConfig, MoADrafter
    from swiftk.proposers.draft_head import frequent_token_ids

    e = swiftk.load(a.model, persist=False)
    text = C.corpus(e.target, ["stdlib", "site-packages", "docs"], a.tokens, progress=False)
    ids = frequent_token_ids(e.tokenizer, 8192, model_name=str(e.identity.get("name") or "model"))
    rows, held_rows = C.chunks(text["train"], a.chunk), C.chunks(text["held_out"], a.chunk)[: a.chunks]
    torch.set_flush_denormal(True)   # as train.train: softmax gradients underflow to denormals
    drafters, opts, frozen, spent = {}, {}, {}, {}
    for lb, o in arms.items():
        torch.manual_seed(0)
        drafters[lb] = MoADrafter(MoAConfig.for_target(e.config, **o))
        opts[lb] = torch.optim.AdamW(drafters[lb].parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.98))
        frozen[lb] = T.Frozen(e.model, drafters[lb].cfg.tli, ids)
        spent[lb] = 0.0
    max_tli = max(d.cfg.tli for d in drafters.values())
    probs = T.offset_probs(max(d.cfg.max_offset for d in drafters.values()))
    t0, t_target, b, log = time.perf_counter(), 0.0, None, []
    for step in range(a.steps):
        if b is None or step % a.reuse == 0:
            t = time.perf_counter()
            b = D.batch_features(e.model, rows[T._batches(len(rows), a.batch, 0, step // a.reuse)], max_tli)
            t_target += time.perf_counter() - t
        offsets = T.draw_offsets(probs, b["tokens"].shape, 0, step)
        line = []
        for lb, d in drafters.items():   # arms alternate step by step: machine drift hits each alike
            t = time.perf_counter()
            kl, _ = T.train_step(d, opts[lb], frozen[lb], b, offsets, T.schedule(a.lr, step, a.steps), 1.0)
            spent[lb] += time.perf_counter() - t
            line.append(f"{lb} {kl.item():.3f}")
        if step % max(1, a.steps // 10) == 0 or step == a.steps - 1:
            el = time.perf_counter() - t0
            log.append((step + 1, line))
            print(f"step {step + 1}/{a.steps} kl: {', '.join(line)}; {el / 60:.1f} min, "
                  f"ETA {el / (step + 1) * (a.steps - step - 1) / 60:.1f} min", flush=True)
    held = [{k: v[0] for k, v in D.batch_features(e.model, held_rows[i:i + 1], max_tli).items()}
            for i in range(len(held_rows))]
    res = {}
    for lb, d in drafters.items():
        res[lb] = {"options": arms[lb], "parameters": d.n_params(), "train_s": round(spent[lb], 1),
                   "held_out": T.evaluate(d, frozen[lb], held, ids, 4)}
        print(f"{lb}: {d.n_params():,} parameters, {spent[lb]:.0f} s, held-out by depth "
              f"{res[lb]['held_out']['acceptance_by_depth']}", flush=True)
    model = Path(a.model).name.removesuffix(".gguf")
    path = Path(a.out) / f"drafter_arch_{model}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json_atomic(path, {"args": vars(a), "machine": machine_info(e.device, torch.get_num_threads()),
                             "target_s": round(t_target, 1), "train_tokens_seen":
                             -(-a.steps // a.reuse) * a.batch * a.chunk, "held_out_tokens": len(held) * a.chunk,
                             "kl_log": log, "results": res})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
