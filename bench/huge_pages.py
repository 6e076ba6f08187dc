"""Weights in 2 MiB pages against 4 KiB pages (runtime/hugepages.py), one process, arms alternated.

    python -m bench.huge_pages --models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --reps 5

Per model: the load time of each arm (alternated, ``--reps`` each), then two engines side by side (one loaded with
huge pages off, one on) and per repetition, in alternating order: tg128 (128 single-token passes from an empty
cache, with the LM head: bench.versus_native's), pp512 and verify passes of 2 / 4 / 8 / 16 tokens over 128 cached
(in ms), with the read bandwidth measured beside them. Reports true medians of the odd ``--reps`` and every
repetition, the bytes each arm's weights hold in huge pages, and whether both arms' greedy tokens are equal. Writes
``huge_pages_<stamp>.json`` / ``.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import statistics
import time
from pathlib import Path

import torch

from bench.versus_native import VERIFY, swiftk_pp, swiftk_tg, swiftk_verify

ARMS = ("4k", "huge")


def measure(name: str, reps: int) -> dict:
    import swiftk
    from benchlib.machine import read_bandwidth
    from swiftk.runtime import hugepages
    from swiftk.runtime.weights import weight_pages

    load_s = {a: [] for a in ARMS}
    swiftk.load(name, persist=False, datastore=False)   # the file in the page cache before any timed load
    gc.collect()
    for r in range(reps):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            hugepages.ENABLED = arm == "huge"
            t0 = time.perf_counter()
            eng = swiftk.load(name, persist=False, datastore=False)
            load_s[arm].append(time.perf_counter() - t0)
            del eng
            gc.collect()
    engs = {}
    for arm in ARMS:
        hugepages.ENABLED = arm == "huge"
        engs[arm] = swiftk.load(name, persist=False, datastore=False)
        swiftk_tg(engs[arm], 16)
    hugepages.ENABLED = True
    runs = []
    for r in range(reps):
        row = {"read_gb_s": read_bandwidth()}
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            e = engs[arm]
            row[f"{arm}_tg128"] = swiftk_tg(e)
            row[f"{arm}_pp512"] = swiftk_pp(e)
            v = swiftk_verify(e)
            row.update({f"{arm}_verify{T}_ms": v[T] * 1e3 for T in (1, *VERIFY)})
        print(f"# {name} rep {r + 1}/{reps}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        runs.append(row)
    med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
    toks = {a: engs[a].generate("def quicksort(arr):", max_new_tokens=32, method="autoregressive").token_ids
            for a in ARMS}
    return {"model": name, "weight_bytes": engs["huge"].model.weight_bytes(),
            "huge_page_bytes": {a: weight_pages(engs[a].model)["huge_page_bytes"] for a in ARMS},
            "load_s": load_s, "load_s_median": {a: statistics.median(load_s[a]) for a in ARMS},
            "runs": runs, "median": med, "tokens_equal": toks["4k"] == toks["huge"]}


def table(results) -> str:
    lines = ["| model | in 2 MiB pages | load s, 4k / huge | tg128 4k / huge | ratio | pp512 4k / huge | ratio | "
             "verify " + " / ".join(map(str, (1, *VERIFY))) + " ms, 4k | huge | read GB/s | tokens equal |",
             "|---|---:|---|---|---:|---|---:|---|---|---:|---|"]
    for x in results:
        m = x["median"]
        v4 = " / ".join(f"{m[f'4k_verify{T}_ms']:.1f}" for T in (1, *VERIFY))
        vh = " / ".join(f"{m[f'huge_verify{T}_ms']:.1f}" for T in (1, *VERIFY))
        lines.append(
            f"| {x['model']} | {x['huge_page_bytes']['huge'] / x['weight_bytes']:.0%} | "
            f"{x['load_s_median']['4k']:.2f} / {x['load_s_median']['huge']:.2f} | {m['4k_tg128']:.1f} / "
            f"{m['huge_tg128']:.1f} | **{m['huge_tg128'] / m['4k_tg128']:.2f}x** | {m['4k_pp512']:.0f} / "
            f"{m['huge_pp512']:.0f} | {m['huge_pp512'] / m['4k_pp512']:.2f}x | {v4} | {vh} | {m['read_gb_s']:.1f} | "
            f"{'yes' if x['tokens_equal'] else 'NO'} |")
    lines.append("")
    lines.append("Every repetition (tg128 4k / huge): " + "; ".join(
        f"{x['model']}: " + ", ".join(f"{r['4k_tg128']:.1f} / {r['huge_tg128']:.1f}" for r in x["runs"])
        for x in results))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--reps", type=int, default=5, help="odd: the median is a run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.reps % 2 == 0:
        ap.error("--reps must be odd (the median is then a run)")
    torch.set_num_threads(a.threads)
    from benchlib.machine import machine_info
    from swiftk.atomic import write_json_atomic
    from swiftk.runtime import hugepages

    results = [measure(n, a.reps) for n in a.models.split(",")]
    meta = {"args": vars(a), "machine": machine_info("cpu", a.threads), "thp": hugepages.status()}
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / f"huge_pages_{stamp}.json", {"meta": meta, "results": results})
    md = (f"# huge_pages {stamp}\n\n{meta['machine']['cpu_arch']}, {a.threads} threads, transparent huge pages: "
          f"{meta['thp']}; swiftk {meta['machine'].get('git_commit')}; median of {a.reps} alternated "
          f"repetitions.\n\n" + table(results) + "\n")
    (out / f"huge_pages_{stamp}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
