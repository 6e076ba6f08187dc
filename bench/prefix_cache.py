"""A conversation's next turn with and without the previous call's KV (the ``prefix_cache`` decode option).

    python -m bench.prefix_cache --model smollm2-135m --n 8 --max-new-tokens 128

For the first ``n`` MT-Bench questions: turn 1 on engine A, then turn 2 (the question, the model's own turn-1
answer, the follow-up; through the chat template) on A, which reuses what turn 1 left in its cache, and on engine B
with ``prefix_cache=False`` (the whole prompt prefilled), each timed around ``generate``. Both engines run the
default method; their turn-2 outputs must be identical. Prints prompt tokens, tokens reused, prefill and wall time of
each side, and writes bench/results/prefix_cache_<model>_<time>.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import swiftk
from benchlib import workloads
from benchlib.machine import set_threads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=8, help="MT-Bench questions (the first of each category, in order)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    set_threads(a.threads)
    qs = workloads.mtbench(1)[:a.n]
    reuse, whole = swiftk.load(a.model, persist=False), swiftk.load(a.model, persist=False)
    for e in (reuse, whole):
        e.generate("warm up", max_new_tokens=8, prefix_cache=False)   # kernels, draft head
    rows = []
    for q in qs:
        first = reuse.generate(q["turns"][0], max_new_tokens=a.max_new_tokens, chat=True)
        msgs = workloads.multiturn_messages(q, first.text)
        t = time.perf_counter()
        got = reuse.generate(msgs, max_new_tokens=a.max_new_tokens, chat=True)
        wall_reuse = time.perf_counter() - t
        t = time.perf_counter()
        ref = whole.generate(msgs, max_new_tokens=a.max_new_tokens, chat=True, prefix_cache=False)
        wall_whole = time.perf_counter() - t
        if got.token_ids != ref.token_ids:
            raise SystemExit(f"{q['id']}: turn 2 differs between the reusing and the whole-prefill engine")
        rows.append({"id": q["id"], "prompt_tokens": got.stats.prompt_tokens, "reused": got.stats.prompt_reused,
                     "new_tokens": len(got.token_ids), "prefill_reuse_s": got.stats.time_prefill_s,
                     "prefill_whole_s": ref.stats.time_prefill_s, "wall_reuse_s": wall_reuse,
                     "wall_whole_s": wall_whole})
    tot = {k: sum(r[k] for r in rows) for k in rows[0] if k != "id"}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    lines = [f"# prefix_cache: MT-Bench turn 2 after turn 1, {a.model}, {time.strftime('%Y-%m-%d %H:%M')}", "",
             f"`python -m bench.prefix_cache --model {a.model} --n {a.n} --max-new-tokens {a.max_new_tokens}`; "
             "default method, greedy, turn-2 outputs identical on both engines", "",
             "| question | prompt tokens | reused | prefill reuse (s) | prefill whole (s) | wall reuse (s) | wall whole (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows + [{"id": "all", **tot}]:
        lines.append(f"| {r['id']} | {r['prompt_tokens']} | {r['reused']} | {r['prefill_reuse_s']:.3f} | "
                     f"{r['prefill_whole_s']:.3f} | {r['wall_reuse_s']:.3f} | {r['wall_whole_s']:.3f} |")
    lines += ["", f"Reused {tot['reused'] / tot['prompt_tokens']:.0%} of the prompt tokens; prefill "
              f"{tot['prefill_whole_s'] / tot['prefill_reuse_s']:.1f}x shorter, wall time "
              f"{tot['wall_whole_s'] / tot['wall_reuse_s']:.2f}x shorter."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = f"prefix_cache_{a.model}_{stamp}"   # no with_suffix: model names hold dots
    (out / f"{base}.md").write_text(text)
    (out / f"{base}.json").write_text(json.dumps({"args": vars(a), "rows": rows, "total": tot}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
