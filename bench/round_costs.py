"""Where a call's time goes against plain decoding. The default ``generate`` and swiftk autoregressive (on an engine
of its own) decode the same held-out prompts, alternated per repetition, the default with a fresh learned state per
repetition. The default's decode time splits into its plain steps, its verify rounds (the pass, acceptance and
learning: the loop's verify timer less the plain steps) and the rest, the host work between passes (the sources,
the tree, the round's bookkeeping). Against autoregressive's time a token it reports, as shares of autoregressive's
decode time: what the verify rounds saved (their tokens at that step, less their time), what the plain steps cost
beyond it, and the host work; with the median plain step after a plain round and after a verify pass, and the host
time before it. Each call's prefill is left out on both sides. Every output must equal autoregressive's.

    python -m bench.round_costs --model smollm2-135m --categories stem,reasoning --reps 3

Writes bench/results/round_costs_<model>_<date>.json.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.round_costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="mtbench", choices=("mtbench", "humaneval", "edit", "chat"))
    ap.add_argument("--categories", default="", help="MT-Bench categories to keep (comma-separated; all if empty)")
    ap.add_argument("--n", type=int, default=2, help="prompts (MT-Bench: questions per category)")
    ap.add_argument("--skip", type=int, default=None,
                    help="pass over the first prompts (MT-Bench: per category): held out (default 2 / 20)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.skip is None:
        a.skip = 2 if a.workload == "mtbench" else 20
    if a.reps < 1 or a.n < 1 or a.skip < 0 or a.max_new_tokens < 2:
        raise SystemExit("--reps and --n must be >= 1, --skip >= 0, --max-new-tokens >= 2")

    import torch
    import swiftk
    import swiftk.decoding.loop as loop
    from benchlib.machine import machine_info
    from benchlib.prompts import build_prompts
    from swiftk.atomic import write_json_atomic

    eng_ar, eng = swiftk.load(a.model), swiftk.load(a.model)
    mt = a.workload == "mtbench"
    items = build_prompts(eng, [a.workload], 0 if mt else a.n, a.n, a.max_new_tokens, 0 if mt else a.skip,
                          a.skip if mt else 0)[a.workload]
    cats = {c for c in a.categories.split(",") if c}
    if cats:
        items = [it for it in items if it["category"] in cats]
    if not items:
        raise SystemExit(f"no prompts (categories {sorted(cats)})")
    for e in (eng_ar, eng):
        e.generate(items[0]["ids"], max_new_tokens=16, method="autoregressive")   # kernels, corpus tables

    # the plain steps' own time, and what preceded each (a plain round or a verify pass) with the host time between
    steps, last = [], {"kind": "start", "t": 0.0, "on": False}   # on: a default call runs (AR's are not recorded)
    run = loop.Decoder.run

    def timed_run(self, p):   # a round's pass alone: plain steps timed, with the host time since the last pass
        t = time.perf_counter()
        out = run(self, p)
        if last["on"] and p.kind == "plain":
            steps.append((last["kind"], time.perf_counter() - t, t - last["t"]))
        if p.kind != "prefill":
            last["kind"], last["t"] = p.kind, time.perf_counter()
        return out

    loop.Decoder.run = timed_run
    tot = dict.fromkeys(("ar_s", "ar_tokens", "def_s", "def_tokens", "plain_s", "plain_n", "timed_s"), 0.0)
    try:
        for r in range(a.reps):
            state = eng.new_state()   # fresh per repetition: a user's first calls, search and learning included
            for it in items:
                outs = {}
                for arm in (("ar", "def") if r % 2 == 0 else ("def", "ar")):
                    if arm == "ar":
                        out = eng_ar.generate(it["ids"], max_new_tokens=a.max_new_tokens, method="autoregressive",
                                              prefix_cache=False)
                    else:
                        n0, t0 = len(steps), sum(x[1] for x in steps)
                        last["kind"], last["on"] = "start", True
                        try:
                            out = eng.generate(it["ids"], max_new_tokens=a.max_new_tokens, prefix_cache=False,
                                               state=state)
                        finally:
                            last["on"] = False
                        tot["plain_n"] += len(steps) - n0
                        tot["plain_s"] += sum(x[1] for x in steps) - t0
                        tot["timed_s"] += out.stats.time_verify_s
                    s = out.stats
                    tot[f"{arm}_s"] += s.wall_time_s - s.time_prefill_s
                    tot[f"{arm}_tokens"] += s.new_tokens - 1
                    outs[arm] = out.token_ids
                if outs["ar"] != outs["def"]:
                    raise SystemExit(f"{it['id']}: the default's output differs from autoregressive's")
    finally:
        loop.Decoder.run = run
    if min(tot["ar_tokens"], tot["def_tokens"]) < 1:
        raise SystemExit("every call stopped after its first token: nothing to time (raise --max-new-tokens)")

    res = summarize(tot, steps)
    step, share, med, verify_tokens = (res["ar_us_per_token"] / 1e6, res["shares_of_ar_decode"],
                                       res["plain_step_medians"], res["verify_tokens"])
    print(f"default / AR, decode: {res['decode_ratio']:.3f}x over {tot['def_tokens']:.0f} tokens "
          f"({tot['plain_n']:.0f} from plain steps, {verify_tokens:.0f} from verify rounds); AR {step * 1e6:.0f} us a "
          f"token")
    print(f"of AR's decode time: verify rounds saved {share['verify_saved']:+.1%}, plain steps cost "
          f"{share['plain_excess']:+.1%} beyond AR's, host work {share['host']:.1%} "
          f"({res['host_us_per_token']:.0f} us a token)")
    for k, v in med.items():
        print(f"plain step {k.replace('_', ' ')}: median {v['step_us']:.0f} us, host before it "
              f"{v['host_before_us']:.0f} us ({v['n']} steps)")
    model = Path(a.model).name.removesuffix('.gguf')   # a registry name whole, a file's stem
    path = Path(a.out) / f"round_costs_{model}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json_atomic(path, {"args": vars(a), "machine": machine_info(eng.device, torch.get_num_threads()),
                             "prompts": len(items), **res})
    print(f"wrote {path}")
    return 0


def summarize(tot: dict, steps: list) -> dict:
    """The report from the totals (seconds and counts: ar_s, ar_tokens, def_s, def_tokens, plain_s, plain_n,
    timed_s = the default's verify timer) and the plain steps (what preceded each, its seconds, the host seconds
    before it). With equal token counts, def_s = ar_s x (1 - verify_saved + plain_excess + host)."""
    step = tot["ar_s"] / tot["ar_tokens"]
    verify_tokens = tot["def_tokens"] - tot["plain_n"]   # every decoded token came from a plain step or a verify round
    verify_s = tot["timed_s"] - tot["plain_s"]
    host_s = tot["def_s"] - tot["timed_s"]
    share = {"verify_saved": (verify_tokens * step - verify_s) / tot["ar_s"],
             "plain_excess": (tot["plain_s"] - tot["plain_n"] * step) / tot["ar_s"],
             "host": host_s / tot["ar_s"]}
    med = {}
    for kind in ("plain", "verify"):
        xs = [x for x in steps if x[0] == kind]
        if xs:
            med[f"after_{kind}"] = {"n": len(xs), "step_us": statistics.median(x[1] for x in xs) * 1e6,
                                    "host_before_us": statistics.median(x[2] for x in xs) * 1e6}
    return {"ar_us_per_token": step * 1e6, "decode_ratio": step / (tot["def_s"] / tot["def_tokens"]),
            "tokens": tot["def_tokens"], "plain_steps": tot["plain_n"], "verify_tokens": verify_tokens,
            "shares_of_ar_decode": share, "plain_step_medians": med,
            "host_us_per_token": host_s / tot["def_tokens"] * 1e6}


if __name__ == "__main__":
    raise SystemExit(main())
