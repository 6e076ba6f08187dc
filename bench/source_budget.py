"""The free sources' host-time budget (swiftk.decoding.budget.SourceBudget) on and off, side by side in one process:
swiftk autoregressive, the default, and the default with every source consulted every round, interleaved prompt by
prompt (the order alternating), each speculative arm with its own learned state per workload. Prints default ÷ AR
per workload for both and how many prompts each ran slower than AR. Wall time with the prefill; every output must
equal autoregressive's.

    python -m bench.source_budget --model smollm2-135m --n 5 --skip 20
"""
from __future__ import annotations

import argparse
import collections
import time

WORKLOADS = ("humaneval", "mtbench", "edit", "chat", "multiturn")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.source_budget", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=5, help="HumanEval, edit and chat prompts")
    ap.add_argument("--n-mtbench", type=int, default=1, help="MT-Bench questions per category")
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--skip-mtbench", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)

    import swiftk
    import swiftk.decoding.loop as loop
    from benchlib.prompts import build_prompts
    from swiftk.decoding.budget import SourceBudget

    class EveryRound(SourceBudget):   # the budget off: every source, every round
        def __init__(self, names, auto=True, **kw):
            super().__init__(names, False, **kw)

    eng = swiftk.load(a.model)
    prompts = build_prompts(eng, list(WORKLOADS), a.n, a.n_mtbench, a.max_new_tokens, a.skip, a.skip_mtbench)
    warm = prompts["humaneval"][0]["ids"]
    eng.generate(warm, max_new_tokens=16, method="autoregressive")
    eng.generate(warm, max_new_tokens=16, state=eng.new_state())
    arms = ("ar", "budget", "every-round")
    total = collections.Counter()
    print(f"# {a.model}, {a.max_new_tokens} new tokens, --skip {a.skip}; default ÷ swiftk autoregressive")
    for w, items in prompts.items():
        states = {arm: eng.new_state() for arm in arms[1:]}
        wall, slower = collections.Counter(), collections.Counter()
        for i, it in enumerate(items):
            res = {}
            for arm in (arms if i % 2 == 0 else arms[::-1]):
                loop.SourceBudget = EveryRound if arm == "every-round" else SourceBudget
                kw = {"method": "autoregressive"} if arm == "ar" else {"state": states[arm]}
                t = time.perf_counter()
                r = eng.generate(it["ids"], max_new_tokens=a.max_new_tokens, prefix_cache=False, **kw)
                res[arm] = (time.perf_counter() - t, r.token_ids)
            loop.SourceBudget = SourceBudget
            for arm in arms:
                if res[arm][1] != res["ar"][1]:
                    raise SystemExit(f"{arm} differs from autoregressive on {it['id']}: not lossless")
                wall[arm] += res[arm][0]
                total[arm] += res[arm][0]
                slower[arm] += arm != "ar" and res[arm][0] > res["ar"][0]
        print(f"{w:10} n={len(items)}  " + "  ".join(
            f"{arm}: {wall['ar'] / wall[arm]:.3f}x (slower than AR on {slower[arm]})" for arm in arms[1:]), flush=True)
    print("all          " + "  ".join(f"{arm}: {total['ar'] / total[arm]:.3f}x" for arm in arms[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
