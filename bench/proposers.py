"""User proposers through ``generate(proposers=[...])``: an oracle (the known greedy continuation) and random
tokens, with the default sources and alone, beside swiftk autoregressive and the default ``generate``,
interleaved per prompt in one process.

    python -m bench.proposers --model smollm2-135m --n 4 --max-new-tokens 128

Every arm must give autoregressive's tokens (checked, the run fails otherwise). Each speculative arm gets its own
learned state per prompt, so no arm's outputs draft for another (session history); AR reads none.
Writes bench/results/proposers_<model>_<date>.md.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch


class Oracle:
    """Proposes the reference continuation of the sequence while the sequence follows it."""

    def __init__(self, full: list, k: int = 16):
        self.full, self.k = full, k

    def propose(self, tokens: list) -> list:
        n = len(tokens)
        return self.full[n:n + self.k] if tokens == self.full[:n] else []


class RandomTokens:
    name = "random"

    def __init__(self, vocab: int, seed: int = 0):
        self.rng, self.vocab = random.Random(seed), vocab

    def propose(self, tokens: list) -> list:
        return [self.rng.randrange(self.vocab) for _ in range(8)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=4, help="HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    import swiftk
    from benchlib import workloads

    eng = swiftk.load(a.model, persist=False)
    prompts = [p["turns"][0] for p in workloads.load("humaneval", a.n)]
    eng.generate(prompts[0], max_new_tokens=16, method="autoregressive")   # warm-up: kernels, caches
    eng.generate(prompts[0], max_new_tokens=16, state=eng.new_state())     # draft head, corpus tables
    # "alone": method="ngram" with the built-in free sources off, so the proposer is the only draft
    arms = ("autoregressive", "default", "oracle", "random", "oracle-alone", "random-alone")
    rows = {m: {"tokens": 0, "time": 0.0, "M": [], "rates": []} for m in arms}
    for i, p in enumerate(prompts):
        ref = eng.generate(p, max_new_tokens=a.max_new_tokens, method="autoregressive", prefix_cache=False)
        full = ref.prompt_ids + ref.token_ids
        order = arms if i % 2 == 0 else arms[::-1]   # interleaved: drift hits every arm alike
        for m in order:
            kw = {"method": "autoregressive"} if m == "autoregressive" else {"state": eng.new_state()}
            if m.endswith("alone"):
                kw.update(method="ngram", ngram=False, history=False, datastore=False)
            if m.startswith("oracle"):
                kw["proposers"] = [Oracle(full)]
            elif m.startswith("random"):
                kw["proposers"] = [RandomTokens(eng.config.vocab_size, seed=i)]
            t = time.perf_counter()
            out = eng.generate(p, max_new_tokens=a.max_new_tokens, prefix_cache=False, **kw)   # whole prefills
            dt = time.perf_counter() - t
            if out.token_ids != ref.token_ids:
                raise SystemExit(f"{m}: output differs from autoregressive on prompt {i}")
            r = rows[m]
            r["tokens"] += len(out.token_ids)
            r["time"] += dt
            r["rates"].append(len(out.token_ids) / dt)
            if m != "autoregressive":
                r["M"].append(out.stats.mean_accepted_length)
            print(f"prompt {i} {m:<14} {len(out.token_ids) / dt:7.1f} tok/s  M {out.stats.mean_accepted_length:.2f}",
                  flush=True)
    ar = rows["autoregressive"]["tokens"] / rows["autoregressive"]["time"]
    from benchlib.machine import cpu_model

    cpu = cpu_model()
    lines = [f"# User proposers, {a.model}, float32 CPU ({cpu}, {torch.get_num_threads()} threads), "
             f"{a.n} HumanEval prompts x {a.max_new_tokens} tokens, {time.strftime('%Y-%m-%d')}", "",
             f"`python -m bench.proposers --model {a.model} --n {a.n} --max-new-tokens {a.max_new_tokens}`", "",
             "| arm | tok/s | x autoregressive | mean M | identical output |", "|---|---|---|---|---|"]
    for m in arms:
        r = rows[m]
        tps = r["tokens"] / r["time"]
        mm = f"{statistics.mean(r['M']):.2f}" if r["M"] else "-"
        lines.append(f"| {m} | {tps:.1f} | {tps / ar:.2f}x | {mm} | yes |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out) / f"proposers_{a.model}_{time.strftime('%Y%m%d-%H%M%S')}.md"
    from swiftk.atomic import write_atomic

    write_atomic(out, text.encode())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
