"""A soak of `swiftk serve`: many clients, many requests of mixed lengths, streamed and not, some sampled, some
abandoned mid-way. Reports errors, the server's RSS when warm and at the end, and whether every greedy answer
equals the same prompt decoded alone (plain autoregressive, in process) and every seeded sampled one equals its
alone decoding too.

    python -m bench.soak --model smollm2-135m --clients 8 --requests 200

tests/test_soak.py runs a short one (``run(...)`` below) in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

PROMPTS = ["def quicksort(arr):", "class LRUCache:\n    def __init__(self, capacity: int):",
           "Write a haiku about the sea.", "import json\n\ndef load_config(path):",
           "Explain what a hash table is in two sentences.", "def is_prime(n: int) -> bool:",
           "List three uses of a paperclip.", "async def fetch_all(urls):", "The history of the printing press",
           "def merge_intervals(intervals):\n    \"\"\"Merge overlapping intervals.\"\"\"\n"]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def plan(n: int, seed: int = 0, max_tokens: int = 200) -> list:
    """The requests: prompt, length, streamed or not, greedy or seeded sampling, abandoned after k chunks."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sampled = rng.random() < 0.2
        out.append({"i": i, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, max_tokens),
                    "stream": rng.random() < 0.5, "temperature": 0.8 if sampled else 0.0,
                    "seed": rng.randint(0, 1000) if sampled else None,
                    "abandon": rng.randint(1, 4) if rng.random() < 0.1 else None})
    for r in out:   # only a stream can be abandoned mid-way here
        r["stream"] = r["stream"] or r["abandon"] is not None
    return out


def _one(client, r: dict) -> dict:
    kw = dict(model="m", prompt=r["prompt"], max_tokens=r["max_tokens"], temperature=r["temperature"])
    if r["seed"] is not None:
        kw["seed"] = r["seed"]
    if not r["stream"]:
        resp = client.completions.create(**kw)
        return {"text": resp.choices[0].text, "tokens": resp.usage.completion_tokens, "done": True}
    parts, tokens = [], None
    stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    for k, ch in enumerate(stream):
        if r["abandon"] is not None and k >= r["abandon"]:
            stream.close()
            return {"done": False}
        if ch.usage is not None:
            tokens = ch.usage.completion_tokens
        if ch.choices:
            parts.append(ch.choices[0].text)
    return {"text": "".join(parts), "tokens": tokens, "done": True}


def run(url: str, pid: int, requests: list, clients: int, reference) -> dict:
    """Drive the server at ``url`` (process ``pid``) with ``requests`` from ``clients`` threads; ``reference(r)``:
    (text, tokens) of the request decoded alone. Returns the report."""
    import openai

    lock, todo = threading.Lock(), list(requests)
    got, errors = {}, []

    def worker():
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        while True:
            with lock:
                if not todo:
                    return
                r = todo.pop(0)
            try:
                got[r["i"]] = _one(c, r)
            except Exception as e:  # noqa: BLE001 - counted
                errors.append(f"request {r['i']}: {type(e).__name__}: {e}")

    rss_start = rss_mb(pid)
    t0 = time.perf_counter()
    ths = [threading.Thread(target=worker) for _ in range(clients)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall = time.perf_counter() - t0
    rss_end = rss_mb(pid)
    checked = {"greedy": [0, 0], "sampled": [0, 0]}
    wrong = []
    for r in requests:
        g = got.get(r["i"])
        if g is None or not g["done"]:
            continue
        kind = "greedy" if r["temperature"] == 0 else "sampled"
        want = reference(r)
        checked[kind][1] += 1
        if (g["text"], g["tokens"]) == want:
            checked[kind][0] += 1
        else:
            wrong.append(r["i"])
    return {"requests": len(requests), "clients": clients, "wall_s": round(wall, 1), "errors": errors,
            "abandoned": sum(1 for r in requests if r["abandon"] is not None),
            "rss_mb_start": round(rss_start, 1), "rss_mb_end": round(rss_end, 1),
            "greedy_equal": f"{checked['greedy'][0]}/{checked['greedy'][1]}",
            "sampled_equal": f"{checked['sampled'][0]}/{checked['sampled'][1]}", "wrong": wrong}


def references(eng, requests: list):
    """reference(r) -> (text, completion tokens) of r decoded alone: greedy answers from one autoregressive decode
    per prompt at the longest length asked (a shorter answer is its prefix), sampled ones decoded each."""
    longest: dict = {}
    for r in requests:
        if r["temperature"] == 0:
            longest[r["prompt"]] = max(longest.get(r["prompt"], 0), r["max_tokens"])
    full = {p: eng.generate(p, max_new_tokens=n, method="autoregressive").token_ids for p, n in longest.items()}
    cache: dict = {}

    def reference(r):
        if r["temperature"] == 0:
            ids = full[r["prompt"]][:r["max_tokens"]]
            return eng.tokenizer.decode(ids), len(ids)
        key = (r["prompt"], r["max_tokens"], r["seed"])
        if key not in cache:
            out = eng.generate(r["prompt"], max_new_tokens=r["max_tokens"], temperature=r["temperature"],
                               seed=r["seed"], method="autoregressive")
            cache[key] = (out.text, len(out.token_ids))
        return cache[key]

    return reference


def start_server(model: str, *args):
    """`swiftk serve` on a free port: (process, url) once /health answers."""
    import subprocess

    from bench.serve_load import _free_port, _wait_ready

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "swiftk.cli", "serve", "--model", model, "--port", str(port),
                             "--served-model-name", "m", "--log-level", "warning", *args],
                            env={**os.environ, "SWIFTK_PERSIST": "0"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    _wait_ready(proc, url)
    return proc, url


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    import swiftk

    reqs = plan(a.requests, a.seed, a.max_tokens)
    eng = swiftk.load(a.model, persist=False)
    ref = references(eng, reqs)
    for r in reqs:   # computed before the server runs: the two would share the cores
        if r["abandon"] is None:
            ref(r)
    proc, url = start_server(a.model)
    try:
        run(url, proc.pid, plan(8, a.seed + 1, 16), a.clients, lambda r: (None, None))   # warm
        report = run(url, proc.pid, reqs, a.clients, ref)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    report["server_traceback"] = "Traceback" in err
    print(json.dumps(report, indent=1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"soak_{a.model}_{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps({"args": vars(a),
                                                                                          **report}, indent=1))
    return 0 if not report["errors"] and not report["wrong"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
