"""Two checkouts of swiftk's Python side by side: single-call ``generate`` tokens/s, autoregressive and default.

    python -m bench.checkout_ab --a-src /tmp/base --models smollm2-135m,qwen2.5-coder-0.5b --reps 5

For a change of the Python layers (the driver, the request path), not of the kernels: both arms run the kernel
library installed in this checkout (``swiftk/_native``), so only their Python differs. Per model, one child process
per arm, alive together: each imports swiftk from its arm's source folder, loads the model twice (AR on an engine of
its own, the default on another) and warms both up; then the parent asks for one call at a time, the arms
alternating call by call (which goes first alternates per method from prompt to prompt), so the machine's drift falls on both: held-out prompts
(HumanEval and chat from item 20 on), ``prefix_cache=False``. Tokens/s = generated tokens / wall time of the calls
(prefill included) per repetition, the default from a fresh learned state each repetition. Prints per model and
method the true median over repetitions of each arm's tokens/s, B / A, every repetition, and whether every output
of both arms is the same.
Writes ``checkout_ab_<date>.json`` / ``.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ar", "default")

CHILD = textwrap.dedent(r"""
    import json, sys, time
    from pathlib import Path
    from swiftk.runtime.ops import native
    native.INSTALLED = Path(sys.argv[1])
    import swiftk
    assert Path(swiftk.__file__).resolve().parent.parent == Path(sys.argv[2]).resolve(), swiftk.__file__
    model, n_new = sys.argv[3], int(sys.argv[4])
    prompts = json.loads(sys.stdin.readline())
    engines = {m: swiftk.load(model, persist=False) for m in ("ar", "default")}
    kw = {"ar": {"method": "autoregressive"}, "default": {}}
    for m, e in engines.items():   # kernels, corpus tables, draft head: built before anything is timed
        e.corpus(wait=True)
        e.generate(prompts[0]["text"], chat=prompts[0]["chat"], max_new_tokens=8, **kw[m])
    print("ready", flush=True)
    for line in sys.stdin:   # "<method> <prompt index>": one call, timed, answered on one line
        if line.strip() == "reset":   # a new repetition: the default starts from a fresh learned state
            engines["default"].reset_optimizer()
            print("ok", flush=True)
            continue
        m, i = line.split()
        p = prompts[int(i)]
        t = time.perf_counter()
        out = engines[m].generate(p["text"], chat=p["chat"], max_new_tokens=n_new, prefix_cache=False, **kw[m])
        print(json.dumps({"s": time.perf_counter() - t, "ids": out.token_ids}), flush=True)
""")


class Child:
    """One arm's process: its engines loaded once, then one call per request, so the arms alternate call by call."""

    def __init__(self, src: Path, model: str, items: list, n_new: int):
        env = {**os.environ, "PYTHONPATH": str(src), "SWIFTK_PERSIST": "0"}
        self.p = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT / "swiftk" / "_native"), str(src), model,
                                   str(n_new)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                  cwd=str(src))
        self.where = f"{src} on {model}"
        self._send(json.dumps(items))
        if self._line().strip() != "ready":
            self._fail()

    def _send(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def _line(self) -> str:
        line = self.p.stdout.readline()
        if not line:
            self._fail()
        return line

    def _fail(self):
        self.p.kill()
        raise SystemExit(f"{self.where} failed (its stderr is above)")

    def call(self, method: str, i: int) -> dict:
        self._send(f"{method} {i}")
        return json.loads(self._line())

    def reset(self) -> None:
        self._send("reset")
        if self._line().strip() != "ok":
            self._fail()

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def prompts(n: int) -> list:
    from benchlib import workloads as W

    out = [{"text": it["turns"][0], "chat": False} for it in W.humaneval(20 + n)[20:]]
    return out + [{"text": it["turns"][0], "chat": True} for it in W.chat(20 + n)[20:]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.checkout_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--a-src", required=True, help="arm A: another checkout's root (its swiftk/ is imported)")
    ap.add_argument("--b-src", default=str(ROOT), help="arm B (default: this checkout)")
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--n", type=int, default=3, help="prompts per workload (HumanEval, chat)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3, help="odd: the median is a run's")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.reps % 2 == 0 or a.n < 1:
        raise SystemExit("--reps must be odd and >= 1, --n >= 1")
    from benchlib.machine import machine_info
    from benchlib.results import write_result

    srcs = {"A": Path(a.a_src).resolve(), "B": Path(a.b_src).resolve()}
    items = prompts(a.n)
    models = [m for m in a.models.split(",") if m]
    runs = {m: [] for m in models}   # per repetition: arm -> {"tok_s": {method: ...}, "ids": {method: [...]}}
    for m in models:
        kids = {arm: Child(srcs[arm], m, items, a.max_new_tokens) for arm in srcs}
        k = {meth: 0 for meth in METHODS}   # each method's calls: which arm goes first alternates per prompt
        for r in range(a.reps):
            wall = {arm: {meth: 0.0 for meth in METHODS} for arm in srcs}
            new = {arm: {meth: 0 for meth in METHODS} for arm in srcs}
            ids = {arm: {meth: [] for meth in METHODS} for arm in srcs}
            for c in kids.values():
                c.reset()
            for i in range(len(items)):
                for meth in METHODS:
                    for arm in (("A", "B") if k[meth] % 2 == 0 else ("B", "A")):
                        got = kids[arm].call(meth, i)
                        wall[arm][meth] += got["s"]
                        new[arm][meth] += len(got["ids"])
                        ids[arm][meth].append(got["ids"])
                    k[meth] += 1
            rep = {arm: {"tok_s": {meth: new[arm][meth] / wall[arm][meth] for meth in METHODS}, "ids": ids[arm]}
                   for arm in srcs}
            print(f"rep {r} {m}: " + "; ".join(f"{arm} " + ", ".join(f"{meth} {v:.1f}" for meth, v in
                                                                       rep[arm]["tok_s"].items()) for arm in rep),
                  flush=True)
            runs[m].append(rep)
        for c in kids.values():
            c.close()
    lines = [f"# Checkouts A/B: single-call generate, {a.reps} reps", "",
             f"A = {srcs['A']}, B = {srcs['B']}; {len(items)} prompts (HumanEval + chat, held out), "
             f"{a.max_new_tokens} new tokens, prefill included", "",
             "| model | method | A tok/s | B tok/s | B / A (median) | B / A each rep | outputs equal |", "|---|---|---:|---:|---:|---|---|"]
    summary = {}
    for m, reps in runs.items():
        same = all(x["A"]["ids"] == x["B"]["ids"] and x["A"]["ids"]["ar"] == x["A"]["ids"]["default"] for x in reps)
        for meth in METHODS:
            ta = statistics.median(x["A"]["tok_s"][meth] for x in reps)
            tb = statistics.median(x["B"]["tok_s"][meth] for x in reps)
            each = [x["B"]["tok_s"][meth] / x["A"]["tok_s"][meth] for x in reps]
            summary[f"{m}/{meth}"] = {"a": ta, "b": tb, "b_over_a": statistics.median(each), "each": each,
                                       "outputs_equal": same}
            lines.append(f"| {m} | {meth} | {ta:.1f} | {tb:.1f} | {statistics.median(each):.3f} | "
                         f"{', '.join(f'{v:.3f}' for v in each)} | {'yes' if same else 'NO'} |")
    import torch

    doc = {"args": vars(a), "machine": machine_info(torch.device("cpu"), torch.get_num_threads()),
           "summary": summary, "tok_s": {m: [{k: v["tok_s"] for k, v in x.items()} for x in reps]
                                          for m, reps in runs.items()}}
    print("\n".join(lines))
    write_result(a.out, "checkout_ab", "\n".join(lines) + "\n", doc)
    return 0 if all(v["outputs_equal"] for v in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
