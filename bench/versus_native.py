"""Plain decoding, verify passes and prefill against native llama.cpp as its users measure it: ``llama-bench``
(bench/native_llamacpp.py builds it once from the llama-cpp-python sdist's vendored source), same GGUF file, same
threads, flash attention on (its tools' usual setting).

    python -m bench.versus_native --models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --reps 5

Each repetition, in alternating order: a read-bandwidth probe, ``llama-bench -p 0 -n 128`` (tg128) and ``-p 512
-n 0`` (pp512), and swiftk's model on its own engine doing the same work: 128 single-token passes from an empty
cache with the LM head (tg128), one 512-token pass with the last row's logits (pp512), and verify passes of T
tokens over a 128-token context, each the median of 5 calls, reported in decode steps (a pass of T ÷ a pass of 1).
Reported: the true median of an odd number of repetitions beside every repetition; the weight bytes a decode step
reads ÷ its time, against the read bandwidth measured in the same repetition. Writes ``versus_native_<stamp>.json``
and ``.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

VERIFY = (2, 4, 8, 16)


def llama_bench(gguf: Path, threads: int, p: int, n: int) -> float:
    """tokens/s of one llama-bench run (its own warm-up first)."""
    from bench.native_llamacpp import binary

    r = subprocess.run([str(binary("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", str(p), "-n", str(n),
                        "-fa", "1", "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=900, check=True)
    return float(json.loads(r.stdout)[0]["avg_ts"])


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def swiftk_tg(eng, n: int = 128) -> float:
    """tokens/s of n single-token passes from an empty cache, each with the LM head (llama-bench's tg: no sampling)."""
    m, cache = eng.model, eng.cache
    cache.reset()
    t0 = time.perf_counter()
    for i in range(n):
        pos = torch.tensor([i])
        m.forward(torch.tensor([100 + i % 1000]), pos, pos, cache)
        cache.advance(1)
    return n / (time.perf_counter() - t0)


def swiftk_pp(eng, P: int = 512) -> float:
    """tokens/s of one P-token prefill from an empty cache, logits for its last row only."""
    m, cache = eng.model, eng.cache
    cache.reset()
    pos = torch.arange(P)
    dt = _timed(lambda: m.forward(torch.arange(P) % 1000 + 100, pos, pos, cache, logits_idx=torch.tensor([P - 1])))
    return P / dt


def swiftk_verify(eng, ctx: int = 128, calls: int = 5) -> dict:
    """Seconds of a causal pass of T tokens over ``ctx`` cached ones (median of ``calls``), for T = 1 and VERIFY."""
    m, cache = eng.model, eng.cache
    cache.reset()
    pos = torch.arange(ctx)
    m.forward(torch.arange(ctx) % 1000 + 100, pos, pos, cache, logits_idx=torch.tensor([ctx - 1]))
    cache.advance(ctx)
    out = {}
    for T in (1, *VERIFY):
        ids, p = torch.full((T,), 5), torch.arange(ctx, ctx + T)
        out[T] = statistics.median(_timed(lambda: m.forward(ids, p, p, cache)) for _ in range(calls))
    return out


def measure(name: str, reps: int, threads: int) -> dict:
    import swiftk
    from benchlib.machine import read_bandwidth
    from swiftk.loading.registry import resolve_model

    gguf = resolve_model(name)
    eng = swiftk.load(name, persist=False, datastore=False)
    swiftk_tg(eng, 16)   # warm: the first passes page the weights in
    runs = []
    for r in range(reps):
        row = {"read_gb_s": read_bandwidth()}
        arms = ("llama", "swiftk") if r % 2 == 0 else ("swiftk", "llama")
        for arm in arms:
            if arm == "llama":
                row["llama_tg128"] = llama_bench(gguf, threads, 0, 128)
                row["llama_pp512"] = llama_bench(gguf, threads, 512, 0)
            else:
                row["swiftk_tg128"] = swiftk_tg(eng)
                row["swiftk_pp512"] = swiftk_pp(eng)
                v = swiftk_verify(eng)
                row["step_ms"] = v[1] * 1e3
                row.update({f"verify{T}_steps": v[T] / v[1] for T in VERIFY})
        row["swiftk_gb_s"] = eng.model.weight_bytes() * row["swiftk_tg128"] / 1e9
        print(f"# {name} rep {r + 1}/{reps}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        runs.append(row)
    med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
    info = eng.info()
    return {"model": name, "gguf": str(gguf), "weight_bytes": eng.model.weight_bytes(), "runs": runs, "median": med,
            "formats": info.get("weight_formats") or info.get("weights")}


def table(results: list) -> str:
    lines = ["| model | read GB/s | llama-bench tg128 | swiftk tg128 | ratio | swiftk GB/s (share of read) "
             "| llama-bench pp512 | swiftk pp512 | ratio | verify 2 / 4 / 8 / 16 tokens, in steps |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for res in results:
        m = res["median"]
        lines.append(f"| {res['model']} | {m['read_gb_s']:.1f} | {m['llama_tg128']:.1f} | {m['swiftk_tg128']:.1f} | "
                     f"{m['swiftk_tg128'] / m['llama_tg128']:.2f}x | {m['swiftk_gb_s']:.1f} "
                     f"({m['swiftk_gb_s'] / m['read_gb_s']:.0%}) | {m['llama_pp512']:.1f} | {m['swiftk_pp512']:.1f} | "
                     f"{m['swiftk_pp512'] / m['llama_pp512']:.2f}x | "
                     + " / ".join(f"{m[f'verify{T}_steps']:.2f}" for T in VERIFY) + " |")
    lines.append("")
    lines.append("Medians of the repetitions (each column on its own); every repetition:")
    for res in results:
        lines.append(f"- {res['model']}: " + "; ".join(
            f"tg {x['llama_tg128']:.1f} vs {x['swiftk_tg128']:.1f}, pp {x['llama_pp512']:.0f} vs "
            f"{x['swiftk_pp512']:.0f}, verify8 {x['verify8_steps']:.2f}, read {x['read_gb_s']:.1f} GB/s"
            for x in res["runs"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--reps", type=int, default=5, help="odd: the median is a run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.reps % 2 == 0:
        ap.error("--reps must be odd (the median is then a run)")
    torch.set_num_threads(a.threads)
    from benchlib.machine import machine_info
    from bench.native_llamacpp import build_info, ensure
    from swiftk.atomic import write_json_atomic
    from swiftk.loading.registry import resolve_model

    ensure()
    names = a.models.split(",")
    results = [measure(n, a.reps, a.threads) for n in names]
    meta = {"args": vars(a), "machine": machine_info("cpu", a.threads),
            "llamacpp": build_info(resolve_model(names[0]), a.threads)}
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / f"versus_native_{stamp}.json", {"meta": meta, "results": results})
    ll = meta["llamacpp"]
    commit = "" if ll.get("build_commit") in (None, "unknown") else f" {ll['build_commit']}"   # none in an sdist
    md = (f"# versus_native {stamp}\n\n{meta['machine']['cpu_arch']}, {a.threads} threads; native llama.cpp{commit} "
          f"({ll.get('sdist')}, {ll.get('cmake')}), -fa 1; swiftk {meta['machine'].get('git_commit')}; median of "
          f"{a.reps} alternated repetitions.\n\n" + table(results) + "\n")
    (out / f"versus_native_{stamp}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
