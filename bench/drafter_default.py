"""A trained drafter against the default and plain decoding, on held-out prompts.

    python -m bench.drafter_default --model smollm2-135m --drafter PATH --workload humaneval,chat,mtbench --reps 3

Arms, each on an engine of its own, alternated per prompt (the order rotates): ``ar`` (autoregressive), ``default``
(``generate`` as it is: free sources plus the layer-skip drafter) and ``moa`` (``method="moa"`` with ``--drafter``:
the free sources plus the trained drafter, drafting when the cost model says it pays). Each arm keeps one learned
state per repetition, as a user's session would. Prompts are held out (HumanEval and the chat/edit sets from item
20 on, MT-Bench from the third question of each category). Per workload and repetition: decode tokens/s of each arm
(prefill left out), each arm / AR; the report gives the median over repetitions and every repetition. For the moa
arm also the tokens its drafter got accepted, its mean accepted length per verify pass, and its draft step in decode
steps (the engine's measured figures). Every output must equal AR's. Writes
``bench/results/drafter_default_<model>_<date>.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ARMS = ("ar", "default", "moa")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.drafter_default", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="MoA drafter file (default: the model's own)")
    ap.add_argument("--workload", default="humaneval,chat,mtbench")
    ap.add_argument("--n", type=int, default=4, help="prompts per workload (MT-Bench: per category, 1 by default)")
    ap.add_argument("--n-mtbench", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.n < 1 or a.max_new_tokens < 2:
        raise SystemExit("--reps and --n must be >= 1, --max-new-tokens >= 2")

    import torch
    import swiftk
    from benchlib.machine import machine_info
    from benchlib.prompts import build_prompts
    from swiftk.atomic import write_json_atomic, write_atomic
    from swiftk.moa.method import load_drafter

    engines = {arm: swiftk.load(a.model) for arm in ARMS}
    runner = load_drafter(engines["moa"].target, a.drafter)
    workloads = [w for w in a.workload.split(",") if w]
    items = {}
    for w in workloads:
        mt = w == "mtbench"
        items[w] = build_prompts(engines["ar"], [w], a.n, a.n_mtbench, a.max_new_tokens, 0 if mt else 20,
                                 2 if mt else 0)[w]
    warm = items[workloads[0]][0]["ids"]
    for arm, e in engines.items():   # kernels, corpus tables, draft head: built before anything is timed
        e.generate(warm, max_new_tokens=8, method="autoregressive")
        if arm != "ar":
            e.generate(warm, max_new_tokens=8, **_kw(arm))
    res = {w: [] for w in workloads}
    k = 0
    for r in range(a.reps):
        states = {arm: e.new_state() for arm, e in engines.items() if arm != "ar"}
        for w in workloads:
            tot = {arm: [0.0, 0] for arm in ARMS}
            extra = {"moa_accepted": 0, "moa_drafted": 0}
            for it in items[w]:
                order = ARMS[k % 3:] + ARMS[:k % 3]
                k += 1
                outs = {}
                for arm in order:
                    kw = {"method": "autoregressive"} if arm == "ar" else {**_kw(arm), "state": states[arm]}
                    out = engines[arm].generate(it["ids"], max_new_tokens=a.max_new_tokens, prefix_cache=False, **kw)
                    s = out.stats
                    tot[arm][0] += s.wall_time_s - s.time_prefill_s
                    tot[arm][1] += s.new_tokens - 1
                    outs[arm] = out.token_ids
                    if arm == "moa":
                        extra["moa_accepted"] += s.accepted_by_source.get("draft", 0)
                        extra["moa_drafted"] += s.drafted_tokens
                if len({tuple(v) for v in outs.values()}) != 1:
                    raise SystemExit(f"{w} {it['id']}: outputs differ from autoregressive's")
            tps = {arm: tot[arm][1] / tot[arm][0] for arm in ARMS}
            res[w].append({"tok_s": tps, "vs_ar": {arm: tps[arm] / tps["ar"] for arm in ARMS}, **extra})
    costs = engines["moa"].costs
    step_s = runner.step_s
    summary = {w: {arm: round(statistics.median(x["vs_ar"][arm] for x in rs), 3) for arm in ARMS[1:]}
               for w, rs in res.items()}
    doc = {"args": vars(a), "machine": machine_info(torch.device("cpu"), torch.get_num_threads()),
           "drafter": runner.info, "draft_step_s": step_s, "decode_step_s": costs.step,
           "draft_step_in_steps": None if step_s is None or not costs.step else round(step_s / costs.step, 4),
           "median_vs_ar": summary, "reps": res}
    stem = Path(a.out) / f"drafter_default_{Path(a.model).name.removesuffix('.gguf')}_{time.strftime('%Y%m%d-%H%M%S')}"
    write_json_atomic(Path(f"{stem}.json"), doc)
    lines = [f"# Trained drafter vs default vs AR: {a.model}", "",
             f"drafter: {json.dumps({k: v for k, v in runner.info.items() if k in ('path', 'held_out')})}",
             f"draft step: {doc['draft_step_in_steps']} decode steps; {a.reps} reps, {a.max_new_tokens} new tokens",
             "", "| workload | default / AR | moa / AR | each rep (default; moa) | moa drafter tokens |",
             "|---|---:|---:|---|---:|"]
    for w, rs in res.items():
        each = "; ".join(f"{x['vs_ar']['default']:.2f}, {x['vs_ar']['moa']:.2f}" for x in rs)
        lines.append(f"| {w} | {summary[w]['default']:.2f}x | {summary[w]['moa']:.2f}x | {each} | "
                     f"{statistics.median(x['moa_accepted'] for x in rs)} |")
    write_atomic(Path(f"{stem}.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.md")
    return 0


def _kw(arm: str) -> dict:
    return {} if arm == "default" else {"method": "moa"}


if __name__ == "__main__":
    raise SystemExit(main())
