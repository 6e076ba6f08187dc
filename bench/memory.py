"""Resident memory against issue 83's bound: the GGUF file's size plus the KV cache at its format, plus 10%.

    python -m bench.memory --models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --context 4096

Each model runs in a fresh process: its resident set (VmRSS) after the runtime alone (Python, torch and the kernel
library loaded: what any model pays), after ``swiftk.load``, after a short ``generate`` and after a prompt that fills
the context to within 64 tokens of ``--context`` plus 32 generated tokens, and the peak (VmHWM). Reported against the
file's size plus the cache's bytes (``info()["kv_cache_bytes"]``): the model's own share (resident less the runtime)
and the whole process. Memory does not move with machine noise: one run per model. Writes ``memory_<stamp>.json``
and ``.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
from pathlib import Path


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(model: str, context: int) -> dict:
    """The phases of one model in this process (bytes)."""
    import torch
    import swiftk
    from swiftk.runtime.ops import native

    native.library()
    torch.ones(4) @ torch.ones(4)   # torch's own first-op allocations belong to the runtime
    out = {"runtime": _status_kb("VmRSS")}
    eng = swiftk.load(model, max_context=context)
    out["loaded"] = _status_kb("VmRSS")
    eng.generate("def fibonacci(n):", max_new_tokens=32)
    out["short"] = _status_kb("VmRSS")
    # a long prompt: plain prose repeated, trimmed to context - 64 tokens
    text = ("The committee met on Tuesday to review the budget, the schedule and the open questions about the new "
            "building, and agreed to meet again after the inspection. ") * (context // 20)
    ids = eng.target.tokenizer.encode(text)[: context - 64]
    eng.generate(ids, max_new_tokens=32)
    out["long"] = _status_kb("VmRSS")
    out["peak"] = _status_kb("VmHWM")
    info = eng.info()
    out.update(prompt_tokens=len(ids), file=os.path.getsize(info["model"]["path"]), kv=info["kv_cache_bytes"],
               kv_format=info["kv_cache"], weight_bytes=info["weight_bytes"], max_context=info["max_context"])
    return out


def row(model: str, r: dict) -> str:
    mb = lambda b: f"{b / 1e6:,.0f}"   # noqa: E731
    bound = r["file"] + r["kv"]
    own = r["long"] - r["runtime"]
    return (f"| {model} | {mb(r['file'])} | {mb(r['kv'])} ({r['kv_format']}, {r['max_context']}) | {mb(r['runtime'])} | "
            f"{mb(r['loaded'] - r['runtime'])} | {mb(own)} | **{own / bound:.2f}** | {mb(r['long'])} | "
            f"{mb(r['peak'])} | {r['long'] / bound:.2f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.context)))
        return 0
    from benchlib.machine import machine_info

    results = {}
    for m in a.models.split(","):
        p = subprocess.run([sys.executable, "-m", "bench.memory", "--child", m, "--context", str(a.context)],
                           capture_output=True, text=True, check=True)
        results[m] = json.loads(p.stdout.strip().splitlines()[-1])
    lines = ["# resident memory, MB; bound = file + KV cache; own = after the long prompt less the runtime",
             "| model | file | KV cache (format, slots) | runtime | loaded, own | after long prompt, own | own / bound |"
             " whole process | peak | whole / bound |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [row(m, r) for m, r in results.items()]
    print("\n".join(lines))
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python -m bench.memory " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine_info("cpu", 0), "results": results}
    (out / f"memory_{stamp}.json").write_text(json.dumps(doc, indent=1))
    (out / f"memory_{stamp}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}/memory_{stamp}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
