"""Serving under load: `swiftk serve` against native llama.cpp's llama-server, the way users drive them (the
official ``openai`` client, streamed, concurrent clients on loopback), on the same GGUF file and threads.

Arms, one server at a time, each fresh per phase, in alternated order per repetition:
  swiftk        ``swiftk serve`` (default method; --max-batch default, sized to the machine)
  llama         ``llama-server -np CLIENTS -fa on`` (bench/native_llamacpp.py builds it once), plain
  llama-<spec>  the same with ``--spec-type ngram-simple`` / ``ngram-mod`` (llama.cpp's draft-free speculation)
  inproc        swiftk ``generate`` in this process, one prompt after another (1 client only): what serving costs
  swiftk-a      with ``--a-src DIR``: ``swiftk serve`` from another checkout's Python on this checkout's kernel
                library, for a before/after of a change to the Python layers (``--no-llama`` leaves the peers out)

A phase: CLIENTS threads take the prompts (by default held-out HumanEval completions and chat questions, mixed;
``--workloads`` picks others: ``edit`` requests, MT-Bench turn-1 questions, one workload per run) from one queue
until all are answered; max_tokens, greedy, EOS honoured on both sides. Reported per phase: aggregate completion
tokens/s (tokens / wall), p50/p99 request latency and time to first token, and how many answers equal the
reference: for swiftk, ``generate(method="autoregressive")`` in process, alone; for llama.cpp, its own 1-client
answers (llama.cpp has no batch-invariant mode). Medians over --reps (odd).

    python -m bench.serve_load --model smollm2-135m --clients 1,4,8 --n 6 --reps 3
    python -m bench.serve_load --model smollm2-135m --clients 1 --workloads mtbench --n 1   # 1 per category: 8
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

SPECS = ("ngram-simple", "ngram-mod")
WORKLOADS = ("humaneval", "chat", "edit", "mtbench")
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc, url: str, limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200 and json.loads(r.read()).get("status") in ("ok", None):
                    return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("server did not come up")
        time.sleep(0.3)


class Server:
    """One server process on a free port; ``stop`` ends it (SIGTERM, then kill)."""

    def __init__(self, argv: list, env=None, cwd=None):
        self.port = _free_port()
        self.argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, cwd=cwd)
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            _wait_ready(self.proc, self.url)
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def swiftk_server(model: str, threads: int, src: Optional[Path] = None) -> Server:
    """``swiftk serve``, or with ``src`` another checkout's: its Python (first on the path) on this checkout's
    kernel library, as bench/checkout_ab.py runs it, so that only the Python differs."""
    args = ["serve", "--model", model, "--port", "{port}", "--served-model-name", "m", "--log-level", "warning"]
    env = {"SWIFTK_PERSIST": "0", "OMP_NUM_THREADS": str(threads)}
    if src is None:
        return Server([sys.executable, "-m", "swiftk.cli", *args], env=env)
    return Server([sys.executable, "-c", SERVE_FROM, str(ROOT / "swiftk" / "_native"), str(src), *args],
                  env={**env, "PYTHONPATH": str(src)}, cwd=str(src))


SERVE_FROM = (
    "import sys\nfrom pathlib import Path\nfrom swiftk.runtime.ops import native\n"
    "native.INSTALLED = Path(sys.argv.pop(1))\nsrc = Path(sys.argv.pop(1)).resolve()\nimport swiftk\n"
    "assert Path(swiftk.__file__).resolve().parent.parent == src, swiftk.__file__\n"
    "from swiftk.cli import main\nraise SystemExit(main(sys.argv[1:]))\n")


def llama_server(gguf: Path, clients: int, threads: int, spec: str = "none") -> Server:
    from bench.native_llamacpp import binary

    argv = [str(binary("llama-server")), "-m", str(gguf), "--port", "{port}", "--host", "127.0.0.1",
            "-t", str(threads), "-tb", str(threads), "-np", str(clients), "-c", str(2048 * clients), "-fa", "on",
            "--alias", "m", "--no-webui"]
    if spec != "none":
        argv += ["--spec-type", spec]
    return Server(argv)


def _one(client, item: dict, max_tokens: int) -> dict:
    """One streamed request: its text, completion tokens (usage), latency and time to first token."""
    t0 = time.perf_counter()
    first, parts, tokens = None, [], None
    kw = dict(model="m", max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
    if item["chat"]:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": item["text"]}], **kw)
    else:
        stream = client.completions.create(prompt=item["text"], **kw)
    for ch in stream:
        if ch.usage is not None:
            tokens = ch.usage.completion_tokens
        if not ch.choices:
            continue
        piece = ch.choices[0].delta.content if item["chat"] else ch.choices[0].text
        if piece:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(piece)
    return {"id": item["id"], "text": "".join(parts), "tokens": tokens or 0, "latency_s": time.perf_counter() - t0,
            "ttft_s": first if first is not None else time.perf_counter() - t0}


def phase(url: str, items: list, clients: int, max_tokens: int) -> dict:
    """Every item once, ``clients`` threads pulling from one queue; per-request records and the wall time."""
    import openai

    q: queue.Queue = queue.Queue()
    for it in items:
        q.put(it)
    out, errors = [], []

    def worker():
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        while True:
            try:
                it = q.get_nowait()
            except queue.Empty:
                return
            try:
                out.append(_one(c, it, max_tokens))
            except Exception as e:  # noqa: BLE001 - counted, the phase goes on
                errors.append(f"{it['id']}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    ths = [threading.Thread(target=worker) for _ in range(clients)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return {"wall_s": time.perf_counter() - t0, "requests": sorted(out, key=lambda r: r["id"]), "errors": errors}


def _pct(xs: list, p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def summarize(ph: dict, ref: dict) -> dict:
    reqs = ph["requests"]
    tok = sum(r["tokens"] for r in reqs)
    return {"tok_s": tok / ph["wall_s"], "tokens": tok, "wall_s": ph["wall_s"], "errors": len(ph["errors"]),
            "latency_p50_s": _pct([r["latency_s"] for r in reqs], 50),
            "latency_p99_s": _pct([r["latency_s"] for r in reqs], 99),
            "ttft_p50_s": _pct([r["ttft_s"] for r in reqs], 50), "ttft_p99_s": _pct([r["ttft_s"] for r in reqs], 99),
            # None: no reference (llama.cpp's is its own 1-client run, absent when --clients leaves out 1)
            "equal": sum(1 for r in reqs if ref.get(r["id"]) == r["text"]) if ref else None, "n": len(reqs)}


def _equal(runs: list) -> str:
    """The fewest answers equal to the reference over the runs, or why there is no reference."""
    if any(r["equal"] is None for r in runs):
        return "n/a (no 1-client run)"
    return f"{min(r['equal'] for r in runs)}/{runs[0]['n']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--workloads", default="humaneval,chat", help=f"mixed in one queue, of {', '.join(WORKLOADS)}")
    ap.add_argument("--n", type=int, default=6, help="prompts per workload (MT-Bench: per category, of 8)")
    ap.add_argument("--skip", type=int, default=20, help="held out: pass over the first prompts of each workload")
    ap.add_argument("--skip-mtbench", type=int, default=2, help="held out: the first MT-Bench questions per category")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="odd: the median is a run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--specs", default=",".join(SPECS), help="llama-server --spec-type arms besides plain")
    ap.add_argument("--a-src", default=None, help="also serve from this checkout (arm swiftk-a): a before/after")
    ap.add_argument("--no-llama", action="store_true", help="leave llama-server's arms out")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.reps % 2 == 0:
        raise SystemExit("--reps must be odd")
    clients = [int(c) for c in a.clients.split(",")]
    workloads = [w for w in a.workloads.split(",") if w]
    if not workloads or any(w not in WORKLOADS for w in workloads):
        raise SystemExit(f"--workloads: a comma-separated list of {', '.join(WORKLOADS)}, got {a.workloads!r}")

    import torch

    torch.set_num_threads(a.threads)
    import swiftk
    from benchlib.machine import machine_info, read_bandwidth
    from benchlib.prompts import build_prompts
    from bench.native_llamacpp import build_info, ensure
    from swiftk.loading.registry import resolve_model

    if not a.no_llama:
        ensure()
    gguf = resolve_model(a.model)
    eng = swiftk.load(a.model, persist=False)
    prompts = build_prompts(eng, workloads, a.n, a.n, a.max_tokens, a.skip, a.skip_mtbench)
    items = [{"id": f"{w}/{it['id']}", "text": it["text"], "chat": it["chat"]} for w, its in prompts.items()
             for it in its]
    # the reference: each prompt decoded alone, plain autoregressive, in process
    ref = {}
    for it in items:
        kw = dict(max_new_tokens=a.max_tokens, prefix_cache=False)
        p = [{"role": "user", "content": it["text"]}] if it["chat"] else it["text"]
        ref[it["id"]] = eng.generate(p, method="autoregressive", chat=it["chat"], **kw).text
    arms = ["swiftk", *(["swiftk-a"] if a.a_src else []),
            *([] if a.no_llama else ["llama", *(f"llama-{s}" for s in a.specs.split(",") if s)])]
    gb = [round(read_bandwidth(), 1)]
    results: dict = {}
    llama_ref: dict = {}
    for c in clients:
        for rep in range(a.reps):
            order = arms if rep % 2 == 0 else arms[::-1]
            if c == 1:   # what serving costs against calling generate in process, same prompts, one at a time,
                st = eng.new_state()   # learning from this phase's answers only, as a fresh server does
                t0, n = time.perf_counter(), 0
                for it in items:
                    p = [{"role": "user", "content": it["text"]}] if it["chat"] else it["text"]
                    n += len(eng.generate(p, chat=it["chat"], max_new_tokens=a.max_tokens, prefix_cache=False,
                                          state=st).token_ids)
                results.setdefault((c, "inproc"), []).append({"tok_s": n / (time.perf_counter() - t0)})
            for arm in order:
                if arm.startswith("swiftk"):
                    srv = swiftk_server(a.model, a.threads, Path(a.a_src) if arm == "swiftk-a" else None)
                else:
                    srv = llama_server(gguf, c, a.threads, "none" if arm == "llama" else arm[len("llama-"):])
                try:
                    phase(srv.url, items[:1], 1, 8)   # warm: weights paged in, first-request setup
                    ph = phase(srv.url, items, c, a.max_tokens)
                finally:
                    srv.stop()
                if arm.startswith("llama") and c == 1 and rep == 0:
                    llama_ref[arm] = {r["id"]: r["text"] for r in ph["requests"]}
                s = summarize(ph, ref if arm.startswith("swiftk") else llama_ref.get(arm, {}))
                results.setdefault((c, arm), []).append(s)
                print(f"clients {c} rep {rep + 1}/{a.reps} {arm:18s} {s['tok_s']:7.1f} tok/s  p50 lat "
                      f"{s['latency_p50_s']:.2f}s  p99 ttft {s['ttft_p99_s']:.2f}s  equal {_equal([s])}"
                      f"  errors {s['errors']}", flush=True)
    gb.append(round(read_bandwidth(), 1))
    table = []
    for (c, arm), runs in sorted(results.items()):
        med = statistics.median(r["tok_s"] for r in runs)
        row = {"clients": c, "arm": arm, "tok_s_median": round(med, 1), "tok_s": [round(r["tok_s"], 1) for r in runs]}
        if arm != "inproc":
            mid = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
            row.update({k: round(mid[k], 3) for k in ("latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s")})
            row.update(equal=_equal(runs), errors=sum(r["errors"] for r in runs))
        table.append(row)
    lines = [f"| clients | arm | tokens/s (median of {a.reps}) | runs | p50 / p99 latency s | p50 / p99 TTFT s | "
             "equal to reference | errors |", "|---:|---|---:|---|---|---|---|---:|"]
    for r in table:
        lines.append(f"| {r['clients']} | {r['arm']} | {r['tok_s_median']} | {r['tok_s']} | "
                     f"{r.get('latency_p50_s', '')} / {r.get('latency_p99_s', '')} | "
                     f"{r.get('ttft_p50_s', '')} / {r.get('ttft_p99_s', '')} | {r.get('equal', '')} | "
                     f"{r.get('errors', '')} |")
    for c in clients:
        sw = next(r for r in table if r["clients"] == c and r["arm"] == "swiftk")
        peers = [r for r in table if r["clients"] == c and r["arm"].startswith("llama")]
        if peers:
            best = max(peers, key=lambda r: r["tok_s_median"])
            lines.append(f"\n{c} client(s): swiftk serve / best llama-server ({best['arm']}) = "
                         f"{sw['tok_s_median'] / best['tok_s_median']:.2f}x")
        old = next((r for r in table if r["clients"] == c and r["arm"] == "swiftk-a"), None)
        if old:
            per = [round(x / y, 3) for x, y in zip(sw["tok_s"], old["tok_s"])]
            lines.append(f"\n{c} client(s): swiftk serve / swiftk-a ({a.a_src}) = "
                         f"{sw['tok_s_median'] / old['tok_s_median']:.3f}x (per repetition {per})")
        if c == 1:
            ip = next(r for r in table if r["clients"] == 1 and r["arm"] == "inproc")
            lines.append(f"1 client: swiftk serve / in-process generate = {sw['tok_s_median'] / ip['tok_s_median']:.2f}x")
    one = next((r for r in table if r["clients"] == 1 and r["arm"] == "swiftk"), None)
    for c in clients:
        sw = next(r for r in table if r["clients"] == c and r["arm"] == "swiftk")
        if one and c > 1:
            lines.append(f"{c} clients: swiftk serve / its own 1-client figure = "
                         f"{sw['tok_s_median'] / one['tok_s_median']:.2f}x")
    md = "\n".join(lines)
    print(md)
    meta = {"args": vars(a), "machine": {**machine_info("cpu", a.threads), "read_gb_s": gb}, "gguf": str(gguf),
            "llamacpp": None if a.no_llama else build_info(gguf, a.threads)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"serve_load_{a.model}_{stamp}.json").write_text(json.dumps({**meta, "table": table}, indent=1))
    m = meta["machine"]
    what = (f"Workloads {a.workloads}, {a.n} prompts per workload (MT-Bench: per category, of 8) after the first "
            f"{a.skip} held out (MT-Bench: {a.skip_mtbench} per category), {a.max_tokens} tokens, {a.reps} "
            f"repetitions, {a.threads} threads; commit "
            f"{str(m.get('git_commit'))[:7]}; {m.get('cpu_arch')}; read {m['read_gb_s']} GB/s.")
    (out / f"serve_load_{a.model}_{stamp}.md").write_text(f"# serve_load {a.model}\n\n{what}\n\n{md}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
