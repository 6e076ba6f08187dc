"""Decode speed from a worker thread against the main thread: the same engine, the same prompts, arms alternated
(main, worker, worker, main, ...), each repetition a fresh learned state. Reports each arm's tokens/s per repetition,
their medians and worker / main. Outputs must be identical.

    python -m bench.threads --model smollm2-135m --n 6 --reps 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.threads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=6, help="held-out HumanEval prompts")
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5, help="odd: the median is a run")
    ap.add_argument("--methods", default="autoregressive,swift")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.reps % 2 == 0:
        raise SystemExit("--reps must be odd and >= 1")

    import swiftk
    from benchlib.machine import machine_info, read_bandwidth
    from benchlib.prompts import build_prompts

    eng = swiftk.load(a.model, persist=False)
    eng.corpus(wait=True)
    prompts = [it["ids"] for it in build_prompts(eng, ["humaneval"], a.n, 0, a.max_new_tokens, a.skip)["humaneval"]]
    eng.generate(prompts[0], max_new_tokens=16, method="autoregressive")

    def run(method: str, state) -> tuple:
        n, ids, t0 = 0, [], time.perf_counter()
        for p in prompts:
            r = eng.generate(p, max_new_tokens=a.max_new_tokens, method=method, prefix_cache=False,
                             **({"state": state} if method != "autoregressive" else {}))
            n += len(r.token_ids)
            ids.append(r.token_ids)
        return n / (time.perf_counter() - t0), ids

    def on_worker(method: str, state) -> tuple:
        box = {}
        t = threading.Thread(target=lambda: box.update(out=run(method, state)))
        t.start()
        t.join()
        return box["out"]

    gb = [round(read_bandwidth(), 1)]
    res = {m: {"main": [], "worker": []} for m in a.methods.split(",")}
    for rep in range(a.reps):
        for m in res:
            order = ("main", "worker") if rep % 2 == 0 else ("worker", "main")
            toks = {}
            for arm in order:
                rate, toks[arm] = (run if arm == "main" else on_worker)(m, eng.new_state())
                res[m][arm].append(round(rate, 1))
            if toks["main"] != toks["worker"]:
                raise SystemExit(f"{m}: the worker thread's tokens differ from the main thread's")
        print(f"rep {rep + 1}/{a.reps}", {m: {k: v[-1] for k, v in r.items()} for m, r in res.items()}, flush=True)
    gb.append(round(read_bandwidth(), 1))
    summary = {m: {"main_tok_s": r["main"], "worker_tok_s": r["worker"],
                   "median_main": statistics.median(r["main"]), "median_worker": statistics.median(r["worker"]),
                   "worker_over_main": round(statistics.median(r["worker"]) / statistics.median(r["main"]), 3)}
               for m, r in res.items()}
    for m, s in summary.items():
        print(f"{m}: main {s['median_main']} tok/s, worker {s['median_worker']} tok/s, "
              f"worker / main {s['worker_over_main']}x (medians of {a.reps})")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"threads_{a.model}_{stamp}.json").write_text(json.dumps(
        {"args": vars(a), "machine": {**machine_info(eng.device, torch.get_num_threads()), "read_gb_s": gb},
         "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
