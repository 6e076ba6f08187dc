"""Decode after a long context: swiftk's KV cache in float32 and in float16 (each on an engine of its own) against
native ``llama-bench -d`` and, where built, ik_llama.cpp's ``llama-bench -gp D,N`` plain and with run-time
repacking ``-rtr 1`` (bench/native_llamacpp.py builds both; their caches are float16, flash attention on), same
GGUF file, same threads.

    python -m bench.long_context --models smollm2-135m,qwen2.5-coder-1.5b --depths 0,1024,4096 --reps 3 \
        --ik-src ~/src/ik_llama.cpp

Each engine prefills the deepest context once (untimed here: bench.versus_native times prefill). Each repetition,
arms in rotating order: a read-bandwidth probe, then per depth D ``llama-bench -p 0 -n N -d D`` and, per swiftk
cache type, N single-token passes with the LM head from position D (the cache's committed length set to D; which
values its slots hold does not change the work). Reported: true medians of an odd number of repetitions beside
every repetition, and the bytes a step reads (weights + D x KV bytes per token) / its time against the probe.
Writes ``long_context_<stamp>.json`` and ``.md`` under ``--out``.
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


def peer_tg(arm: str, gguf: Path, threads: int, n: int, depth: int) -> float:
    """tokens/s of a peer's llama-bench decoding n tokens after ``depth`` (its own warm-up and prefill first, not
    timed): mainline's ``-d``, ik's ``-gp depth,n`` (its tool has no -d), ik's with ``-rtr 1`` for arm "ik_rtr"."""
    from bench.native_llamacpp import binary, ik_binary

    if arm == "llama":
        cmd = [str(binary("llama-bench")), "-p", "0", "-n", str(n), "-d", str(depth)]
    else:
        cmd = [str(ik_binary("llama-bench"))] + (["-p", "0", "-n", str(n)] if depth == 0 else
                                                 ["-p", "0", "-n", "0", "-gp", f"{depth},{n}"])
        cmd += ["-rtr", "1"] if arm == "ik_rtr" else []
    r = subprocess.run(cmd + ["-m", str(gguf), "-t", str(threads), "-fa", "1", "-r", "1", "-o", "json"],
                       capture_output=True, text=True, timeout=1800, check=True)
    return float(json.loads(r.stdout)[-1]["avg_ts"])


def prefill(eng, P: int) -> float:
    """Fills the engine's cache with a P-token context (the prompt of bench.versus_native's pp); its seconds."""
    m, cache = eng.model, eng.cache
    cache.reset()
    pos = torch.arange(P)
    t0 = time.perf_counter()
    m.forward(torch.arange(P) % 1000 + 100, pos, pos, cache, logits_idx=torch.tensor([P - 1]))
    dt = time.perf_counter() - t0
    cache.advance(P)
    return dt


def swiftk_tg(eng, depth: int, n: int) -> float:
    """tokens/s of n single-token passes with the LM head from position ``depth`` of the prefilled cache."""
    m, cache = eng.model, eng.cache
    cache.reset()
    cache.advance(depth)
    t0 = time.perf_counter()
    for i in range(n):
        pos = torch.tensor([depth + i])
        m.forward(torch.tensor([100 + i % 1000]), pos, pos, cache)
        cache.advance(1)
    return n / (time.perf_counter() - t0)


def kv_bytes_per_token(eng) -> int:
    c = eng.config
    return c.n_layers * 2 * c.n_kv_heads * c.head_dim * eng.cache.data.element_size()


def measure(name: str, depths: list, kvs: list, peers: list, n: int, reps: int, threads: int) -> dict:
    import swiftk
    from benchlib.machine import read_bandwidth
    from swiftk.loading.registry import resolve_model

    gguf = resolve_model(name)
    deepest = max(depths)
    engines = {kv: swiftk.load(name, persist=False, datastore=False, kv_cache=kv, max_context=deepest + n + 8)
               for kv in kvs}
    setup = {}
    for kv, eng in engines.items():
        swiftk_tg(eng, 0, 8)   # warm: the first passes page the weights in
        setup[kv] = {"prefill_s": prefill(eng, deepest) if deepest else 0.0, "kv_bytes_per_token":
                     kv_bytes_per_token(eng), "arithmetic": eng.model.arithmetic()}
    weight_bytes = next(iter(engines.values())).model.weight_bytes()
    arms = list(peers) + list(kvs)
    runs = []
    for r in range(reps):
        row = {"read_gb_s": read_bandwidth()}
        k = r % len(arms)
        for arm in arms[k:] + arms[:k]:
            for d in depths:
                if arm in peers:
                    row[f"{arm}_d{d}"] = peer_tg(arm, gguf, threads, n, d)
                else:
                    tps = swiftk_tg(engines[arm], d, n)
                    row[f"{arm}_d{d}"] = tps
                    row[f"{arm}_d{d}_gb_s"] = (weight_bytes + (d + n / 2) * setup[arm]["kv_bytes_per_token"]) * tps / 1e9
        print(f"# {name} rep {r + 1}/{reps}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
        runs.append(row)
    med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
    return {"model": name, "gguf": str(gguf), "weight_bytes": weight_bytes, "depths": depths, "kvs": kvs,
            "peers": peers, "n": n, "setup": setup, "runs": runs, "median": med}


def table(results: list) -> str:
    lines = []
    for res in results:
        m, kvs, peers = res["median"], res["kvs"], res["peers"]
        lines += [f"### {res['model']} (weights {res['weight_bytes'] / 1e6:.0f} MB; read {m['read_gb_s']:.1f} GB/s, "
                  f"median)", "",
                  "| depth | " + " | ".join(f"{p} tg" for p in peers) + " | "
                  + " | ".join(f"swiftk {kv} KV | ÷ best peer | GB/s (share)" for kv in kvs) + " |",
                  "|---:|" + "---:|" * len(peers) + "---:|---:|---:|" * len(kvs)]
        for d in res["depths"]:
            best = max(m[f"{p}_d{d}"] for p in peers)
            cells = [f"{m[f'{kv}_d{d}']:.1f} | {m[f'{kv}_d{d}'] / best:.2f}x | "
                     f"{m[f'{kv}_d{d}_gb_s']:.1f} ({m[f'{kv}_d{d}_gb_s'] / m['read_gb_s']:.0%})" for kv in kvs]
            lines.append(f"| {d} | " + " | ".join(f"{m[f'{p}_d{d}']:.1f}" for p in peers) + " | "
                         + " | ".join(cells) + " |")
        lines += ["", "Every repetition (tokens/s, " + " / ".join(peers + kvs) + "):"]
        for d in res["depths"]:
            lines.append(f"- depth {d}: " + "; ".join(
                " / ".join(f"{x[f'{a}_d{d}']:.1f}" for a in peers + kvs) for x in res["runs"]))
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--depths", default="0,1024,4096")
    ap.add_argument("--kv", default="float32,float16", help="swiftk's cache types, an engine each")
    ap.add_argument("--n", type=int, default=64, help="tokens decoded per measurement (llama-bench -n)")
    ap.add_argument("--reps", type=int, default=3, help="odd: the median is a run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ik-src", default=None, help="ik_llama.cpp checkout or git snapshot to build it from, once "
                    "(else $SWIFTK_IK_LLAMA; without either and without a build, the ik arms are left out)")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.reps % 2 == 0:
        ap.error("--reps must be odd (the median is then a run)")
    torch.set_num_threads(a.threads)
    from benchlib.machine import machine_info
    from bench.native_llamacpp import build_info, ensure, ensure_ik, ik_build_info
    from swiftk.atomic import write_json_atomic
    from swiftk.loading.registry import resolve_model

    ensure()
    peers = ["llama"] + (["ik", "ik_rtr"] if ensure_ik(a.ik_src) is not None else [])
    names, depths, kvs = a.models.split(","), [int(x) for x in a.depths.split(",")], a.kv.split(",")
    results = [measure(n, depths, kvs, peers, a.n, a.reps, a.threads) for n in names]
    meta = {"args": vars(a), "machine": machine_info("cpu", a.threads),
            "llamacpp": build_info(resolve_model(names[0]), a.threads),
            "ik_llama": ik_build_info(resolve_model(names[0]), a.threads) if "ik" in peers else None}
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / f"long_context_{stamp}.json", {"meta": meta, "results": results})
    ll, ik = meta["llamacpp"], meta["ik_llama"]
    iks = (f"ik_llama.cpp {ik.get('commit')} ({ik.get('cmake')}; ik_rtr: -rtr 1)" if ik else
           "ik_llama.cpp not built (--ik-src): no ik arms")
    md = (f"# long_context {stamp}\n\n{meta['machine']['cpu_arch']}, {a.threads} threads; native llama.cpp "
          f"({ll.get('sdist')}, {ll.get('cmake')}); {iks}; peers -fa 1 with a float16 cache; swiftk "
          f"{meta['machine'].get('git_commit')}; {a.n} tokens per measurement; median of {a.reps} alternated "
          f"repetitions.\n\n" + table(results) + "\n")
    (out / f"long_context_{stamp}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
