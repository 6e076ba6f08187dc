"""Verify-pass attention on the CPU: tiles of keys shared by a pass's rows against per-token work items, A/B in
one process (the timings interleaved, so the machine's moods hit both arms alike).

    python -m bench.attention --model smollm2-135m --contexts 128,512,1024,2048 --tokens 4,8,16,25

Per context (tokens already in the cache) and pass size T: milliseconds of a pass of T tokens (a causal chain, the
model's default weights, best of ``--reps``) with ``cpu_layers.set_attention_tiles`` on and off, their ratio, and a
plain step for scale. Both arms give the same bits (tests/test_cpu_decode.py checks it). Writes
``attention_<model>_<date>.md`` and ``.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

from swiftk.atomic import write_atomic
from swiftk.errors import SwiftkError


def main(argv=None) -> int:
    from benchlib.machine import set_threads

    ap = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="128,512,1024,2048")
    ap.add_argument("--tokens", default="4,8,16,25", help="pass sizes T")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    try:
        contexts = [int(c) for c in a.contexts.split(",") if c.strip()]
        sizes = [int(t) for t in a.tokens.split(",") if t.strip()]
    except ValueError:
        ap.error("--contexts and --tokens take comma-separated integers")
    if not contexts or not sizes or min(contexts) < 1 or min(sizes) < 1 or max(sizes) > 64 or a.reps < 2:
        ap.error("--contexts >= 1, --tokens in 1..64, --reps >= 2")
    import swiftk
    from swiftk.runtime.ops import cpu_layers, cpu_linear

    try:
        threads = set_threads(a.threads)
        if not cpu_layers.fused_active():
            raise SwiftkError(f"the fused CPU layer loop is unavailable: {cpu_linear.status()}")
        eng = swiftk.load(a.model, persist=False)
        eng.corpus(wait=True)   # no corpus build beside a timing
        m = eng.model
        cache = m.new_cache(max(contexts) + max(sizes) + 1)
    except SwiftkError as e:
        print(f"bench.attention: error: {e}", file=sys.stderr)
        return 2

    rows, out = [], {}
    for ctx in contexts:
        cache.reset()
        m.forward(torch.arange(ctx) % 1000 + 100, torch.arange(ctx), torch.arange(ctx), cache)
        cache.reset()
        cache.advance(ctx)
        best = {}
        for r in range(a.reps + 1):
            for T in [1] + sizes:
                tok, pos = torch.full((T,), 5), torch.arange(ctx, ctx + T)
                for tiles in ((True,) if T == 1 else (True, False)):
                    cpu_layers.set_attention_tiles(tiles)
                    t0 = time.perf_counter()
                    m.forward(tok, pos, pos, cache)
                    dt = time.perf_counter() - t0
                    if r:   # the first round warms up
                        best[(T, tiles)] = min(best.get((T, tiles), float("inf")), dt)
        cpu_layers.set_attention_tiles(True)
        step = best[(1, True)]
        out[ctx] = {"step_ms": step * 1e3, **{f"T{T}": {"tiles_ms": best[(T, True)] * 1e3,
                                                        "per_token_ms": best[(T, False)] * 1e3} for T in sizes}}
        for T in sizes:
            on, off = best[(T, True)], best[(T, False)]
            rows.append(f"| {ctx} | {step * 1e3:.2f} | {T} | {off * 1e3:.2f} ({off / step:.2f}) | "
                        f"{on * 1e3:.2f} ({on / step:.2f}) | {off / on:.2f}x |")
    head = ["| context | step ms | T | per-token items ms (steps) | tiles ms (steps) | tiles speedup |",
            "|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(head + rows))
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    cmd = "python -m bench.attention " + " ".join(argv if argv is not None else sys.argv[1:])
    base = Path(a.out) / f"attention_{a.model}_{stamp}"
    Path(a.out).mkdir(parents=True, exist_ok=True)
    info = {"model": a.model, "date": stamp, "threads": threads, "cpu": platform.processor() or platform.machine(),
            "linear": cpu_linear.status(), "arithmetic": m.arithmetic(), "command": cmd, "results": out}
    write_atomic(str(base) + ".json", json.dumps(info, indent=1))
    write_atomic(str(base) + ".md", f"# bench.attention {a.model} ({stamp}, {threads} threads, {info['arithmetic']})"
                 f"\n\n`{cmd}`\n\n" + "\n".join(head + rows) + "\n")
    print(f"wrote {base}.json/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
