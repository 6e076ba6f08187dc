"""What one pass costs on a CUDA device: plain step, draft step, verify pass, eager vs CUDA graphs, against the
weight-bandwidth roofline; plus the torch profiler's view of one eager step (kernel count, GPU busy time).

python bench/device/profile_step.py --model smollm2-135m [--dtype bfloat16] [--random] --out profile.txt
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

import swiftk
from benchlib.machine import copy_bandwidth
from swiftk.runtime import skipset
from swiftk.atomic import write_atomic
from swiftk.runtime.ops.masks import TreeMask


def timed(f, n=50, warm=5) -> float:
    for _ in range(warm):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    ap.add_argument("--random", action="store_true", help="random weights of the model's shape (no model file)")
    a = ap.parse_args()
    if a.random:   # the model's shape with random weights (bench/conftest.py): no file to carry to the box
        from bench.conftest import SHAPES, random_tensors
        from swiftk.runtime.graphs import GraphRunner
        from swiftk.runtime.model import Model, resolve_dtype

        cfg = SHAPES[a.model]
        m = Model(cfg, random_tensors(cfg), device="cuda", dtype=resolve_dtype(a.dtype))
        m.graphs = GraphRunner(m)
        cache = m.new_cache(4096)
        eng = SimpleNamespace(config=cfg, skip_set_from_layers=lambda attention, mlp: skipset.from_layers(
            cfg.n_layers, attention, mlp))
    else:
        eng = swiftk.load(a.model, device="cuda", dtype=a.dtype, persist=False)
        m, cache = eng.model, eng.cache
    n = 300
    ids = torch.randint(0, eng.config.vocab_size, (n,), device="cuda")
    ar = torch.arange(n, device="cuda")
    m.forward(ids, ar, ar, cache)
    cache.reset()
    cache.advance(n)
    pos = torch.tensor([n], device="cuda")
    tok = ids[-1:]
    L = eng.config.n_layers
    skip = eng.states.from_layers(attention=list(range(2, L - 1, 2)), mlp=list(range(3, L - 1, 2))).to("cuda")
    rows = {}
    graphs = m.graphs
    for mode in ("eager", "graphs"):
        m.graphs = graphs if mode == "graphs" else None
        rows[f"{mode} plain step"] = timed(lambda: m.forward(tok, pos, pos, cache, start=n))
        rows[f"{mode} draft step ({int(skip.sum())}/{2 * L} sublayers skipped)"] = timed(
            lambda: m.forward(tok, pos, pos, cache, skip=skip, start=n))
        for T in (2, 4, 8, 16, 32):
            mask = TreeMask.causal(n, T, "cuda")
            toks = ids[:T]
            p = torch.arange(n, n + T, device="cuda")
            rows[f"{mode} verify T={T}"] = timed(lambda: m.forward(toks, p, p, cache, attn_mask=mask))
    m.graphs = graphs
    # What a new skip set costs the first time (warm-up pass + capture), against an eager draft step.
    skip2 = eng.states.from_layers(attention=list(range(1, L - 1, 3)), mlp=list(range(2, L - 1, 3))).to("cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    m.forward(tok, pos, pos, cache, skip=skip2, start=n)
    torch.cuda.synchronize()
    rows["graphs first draft step of a new skip set (capture)"] = time.perf_counter() - t
    bw = copy_bandwidth("cuda")
    wb = m.weight_bytes()
    base = rows["graphs plain step"]
    lines = [f"device {torch.cuda.get_device_name()}  dtype {a.dtype}  model {a.model}  weights {wb / 1e6:.1f} MB  "
             f"copy bandwidth {bw / 1e9:.0f} GB/s  roofline step {wb / bw * 1e3:.3f} ms",
             f"{'pass':48s} {'ms':>8s} {'x graph step':>12s} {'% roofline':>10s}"]
    for k, v in rows.items():
        lines.append(f"{k:48s} {v * 1e3:8.3f} {v / base:12.2f} {100 * wb / bw / v:10.1f}")
    # The profiler's view of one eager plain step: how many kernels, how long the GPU was busy.
    m.graphs = None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            m.forward(tok, pos, pos, cache, start=n)
        torch.cuda.synchronize()
    m.graphs = graphs
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) for e in ev) / 3 / 1e3
    lines.append(f"eager plain step: {len(ev) / 3:.0f} kernels, GPU busy {busy:.3f} ms of "
                 f"{rows['eager plain step'] * 1e3:.3f} ms wall (the rest: launch gaps)")
    lines.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    lines.append(json.dumps(graphs.info() if graphs else None))
    text = "\n".join(lines)
    print(text)
    write_atomic(a.out, text + "\n")


if __name__ == "__main__":
    main()
