"""Long runs: resident memory and speed over thousands of generated tokens, per method (issue: long runs stay flat).

    python -m bench.longrun --model smollm2-135m --tokens 4096 --methods autoregressive,swift,ngram

Reports, per method, tok/s, resident memory after a 512-token warm-up call and after the long call, and the growth
per 1k tokens. Greedy, chat prompt asking for a long answer; a run that ends early (eos) is reported with its length.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys

import swiftk
from benchlib.machine import set_threads


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.longrun", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--methods", default="autoregressive,swift,ngram")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    set_threads(a.threads)
    eng = swiftk.load(a.model, persist=False, max_context=a.tokens + 64)
    prompt = "Write a very long, detailed history of computing, chapter by chapter."
    rows = []
    for m in a.methods.split(","):
        eng.generate(prompt, max_new_tokens=512, method=m, chat=True)   # warm-up: allocations, learned state
        warm_rss = rss_mb()
        out = eng.generate(prompt, max_new_tokens=a.tokens, method=m, chat=True, prefix_cache=False)
        end = rss_mb()
        n = len(out.token_ids)
        row = {"method": m, "tokens": n, "finish_reason": out.finish_reason, "tokens_per_s": out.stats.tokens_per_s,
               "rss_after_warmup_mb": round(warm_rss, 1), "rss_end_mb": round(end, 1),
               "growth_mb_per_1k_tokens": round((end - warm_rss) / (n / 1000), 2) if n else None,
               "plain_steps": out.stats.plain_steps, "rounds": out.stats.rounds,
               "optimizer_history": len(eng.optimizer.history)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        from swiftk.atomic import write_json_atomic

        write_json_atomic(a.out, {"model": a.model, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
