"""Rounds in which nothing can pay: what a plain round of the default costs over a plain step. The default
``generate`` runs with its engine's cost model told that every verify pass of more than one token costs a million
steps, so the gate takes a plain step every round while the free sources are still consulted as their budget
decides; swiftk autoregressive runs on an engine of its own. Both decode the same held-out prompts, alternated per
repetition. Decode time per token (each call's prefill left out on both sides: the question is a round's cost),
with where the default's extra time goes: its draft timer (the sources and the tree) and the rest of the loop
(Token Recycling's learning from each step's scores included: it runs outside the loop's timers).
Issue 45's target: a plain step plus 1% at most. Every output must equal autoregressive's.

    python -m bench.idle_rounds --model smollm2-135m --n 4 --n-mtbench 1 --reps 3

Writes bench/results/idle_rounds_<model>_<date>.json.
"""
from __future__ import annotations

import argparse
import statistics
import time
import types
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.idle_rounds", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=4, help="HumanEval prompts")
    ap.add_argument("--n-mtbench", type=int, default=1, help="MT-Bench questions per category")
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--skip-mtbench", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.n < 0 or a.n_mtbench < 0 or a.max_new_tokens < 2:
        raise SystemExit("--reps must be >= 1, --n and --n-mtbench >= 0, --max-new-tokens >= 2")

    import torch
    import swiftk
    from benchlib.machine import machine_info
    from benchlib.prompts import build_prompts
    from swiftk.atomic import write_json_atomic

    eng_ar, eng = swiftk.load(a.model), swiftk.load(a.model)
    prompts = build_prompts(eng, ["mtbench", "humaneval"], a.n, a.n_mtbench, a.max_new_tokens, a.skip,
                            a.skip_mtbench)
    ids = [it["ids"] for w in prompts.values() for it in w]
    if not ids:
        raise SystemExit("no prompts: raise --n or --n-mtbench")
    for e in (eng_ar, eng):
        e.generate(ids[0], max_new_tokens=16, method="autoregressive")   # kernels, corpus tables
    real_v = eng.costs.v
    eng.costs.v = types.MethodType(lambda self, T: real_v(T) if T <= 1 else 1e6 * real_v(1), eng.costs)
    eng.generate(ids[0], max_new_tokens=16, state=eng.new_state())

    reps, refs, idle = [], {}, {}
    for r in range(a.reps):
        tot = {arm: {"decode_s": 0.0, "tokens": 0} for arm in ("ar", "idle")}
        parts = {"draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0, "rounds": 0}
        state = eng.new_state()   # fresh per repetition: the sources' estimates and history start as a user's do
        for arm in (("ar", "idle") if r % 2 == 0 else ("idle", "ar")):
            for i, p in enumerate(ids):
                if arm == "ar":
                    out = eng_ar.generate(p, max_new_tokens=a.max_new_tokens, method="autoregressive",
                                          prefix_cache=False)
                    refs[i] = out.token_ids
                else:
                    out = eng.generate(p, max_new_tokens=a.max_new_tokens, prefix_cache=False, state=state)
                    s = out.stats
                    parts["draft_s"] += s.time_draft_s
                    parts["verify_s"] += s.time_verify_s
                    parts["other_s"] += s.time_other_s
                    parts["rounds"] += s.rounds
                    idle[i] = out.token_ids
                s = out.stats
                tot[arm]["decode_s"] += s.wall_time_s - s.time_prefill_s
                tot[arm]["tokens"] += s.new_tokens - 1
        if idle != refs:
            raise SystemExit("the idle default's output differs from autoregressive's: not lossless")
        if min(t["tokens"] for t in tot.values()) < 1:
            raise SystemExit("every call stopped after its first token: nothing to time (raise --max-new-tokens)")
        per = {arm: t["decode_s"] / t["tokens"] for arm, t in tot.items()}
        n = tot["idle"]["tokens"]
        rest = tot["idle"]["decode_s"] - parts["draft_s"] - parts["verify_s"] - parts["other_s"]
        row = {"ar_us_per_token": per["ar"] * 1e6, "idle_us_per_token": per["idle"] * 1e6,
               "idle_over_ar": per["idle"] / per["ar"], "draft_us_per_token": parts["draft_s"] / n * 1e6,
               "step_us_per_token": parts["verify_s"] / n * 1e6, "loop_rest_us_per_token": rest / n * 1e6,
               "verify_rounds": parts["rounds"]}
        reps.append(row)
        print(f"rep {r}: AR {row['ar_us_per_token']:.0f} us/token, idle default {row['idle_us_per_token']:.0f} "
              f"({row['idle_over_ar']:.3f}x): sources and tree {row['draft_us_per_token']:.1f} us, its steps "
              f"{row['step_us_per_token']:.0f} us, the rest of the loop (learning included) "
              f"{row['loop_rest_us_per_token']:.1f} us; "
              f"verify rounds {row['verify_rounds']}", flush=True)
    med = statistics.median(x["idle_over_ar"] for x in reps)
    print(f"median idle default / AR: {med:.3f}x (target <= 1.01x)")
    model = Path(a.model).name.removesuffix('.gguf')   # a registry name whole, a file's stem
    path = Path(a.out) / f"idle_rounds_{model}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json_atomic(path, {"args": vars(a), "machine": machine_info(eng.device, torch.get_num_threads()),
                             "prompts": len(ids), "median_idle_over_ar": med, "reps": reps})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
