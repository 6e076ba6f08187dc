"""Cost of the HTTP server: tokens/s and first-token latency through `swiftk serve` (OpenAI client on loopback)
against in-process ``generate``/``stream`` on the same prompts, interleaved per prompt in one run.

    python -m bench.serve --model smollm2-135m --n 8 --max-new-tokens 128

For each method (autoregressive, then the default) a server subprocess with ``--method`` is started; the bench
process loads its own engine. Both see the prompts in the same order, so their learned states evolve alike.
Every server output must equal the in-process one (the run fails otherwise). Writes
bench/results/serve_<model>_<date>.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def _first_piece(it):
    t = time.perf_counter()
    pieces = []
    first = None
    for piece in it:
        if piece and first is None:
            first = time.perf_counter() - t
        pieces.append(piece)
    return "".join(pieces), first, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=8, help="HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    os.environ["SWIFTK_PERSIST"] = "0"
    # Two engines share the cores here (the server's and the in-process one): with OpenMP's default wait policy
    # the idle one's threads spin and slowed the other by 4-8%; passive waiting measures the server, not that.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import swiftk
    from benchlib import workloads
    from tests.test_serve import Live

    prompts = [p["turns"][0] for p in workloads.load("humaneval", a.n)]
    lines = [f"# swiftk serve vs in-process, {a.model}, {time.strftime('%Y-%m-%d %H:%M')}", "",
             f"{len(prompts)} HumanEval prompts, {a.max_new_tokens} new tokens, greedy; "
             f"`python -m bench.serve --model {a.model} --n {a.n} --max-new-tokens {a.max_new_tokens}`", "",
             "| method | in-process tok/s | server tok/s | server / in-process | first token in-process (ms) | "
             "first token server (ms) |", "|---|---|---|---|---|---|"]
    path = swiftk.loading.registry.resolve_model(a.model) if a.model in swiftk.loading.registry.MODELS else a.model
    for method in ("autoregressive", "swift"):
        srv = Live(path, "--method", method)
        try:
            client = srv.client()
            eng = swiftk.load(str(path), persist=False)
            kw = dict(max_new_tokens=a.max_new_tokens, method=method, temperature=0)
            eng.generate(prompts[0], max_new_tokens=8, method=method)   # warm-up both sides
            client.completions.create(model="smollm2", prompt=prompts[0], max_tokens=8, temperature=0)
            tok = {"in": 0, "srv": 0}
            wall = {"in": 0.0, "srv": 0.0}
            first = {"in": [], "srv": []}
            for i, p in enumerate(prompts):
                for arm in (("in", "srv") if i % 2 == 0 else ("srv", "in")):   # drift hits both alike
                    t = time.perf_counter()
                    if arm == "in":
                        out = eng.generate(p, **kw)
                        text, n = out.text, len(out.token_ids)
                    else:
                        r = client.completions.create(model="smollm2", prompt=p, max_tokens=a.max_new_tokens,
                                                      temperature=0)
                        text, n = r.choices[0].text, r.usage.completion_tokens
                    wall[arm] += time.perf_counter() - t
                    tok[arm] += n
                    if arm == "in":
                        ref = text
                    else:
                        got = text
                if got != ref:
                    raise SystemExit(f"{method}: server output differs from in-process on prompt {i}")
                for arm in ("in", "srv"):   # first-token latency, streaming
                    it = (eng.stream(p, **kw) if arm == "in" else
                          (c.choices[0].text for c in client.completions.create(
                              model="smollm2", prompt=p, max_tokens=a.max_new_tokens, temperature=0, stream=True)
                           if c.choices))
                    first[arm].append(_first_piece(it)[1] * 1e3)
            rin, rsrv = tok["in"] / wall["in"], tok["srv"] / wall["srv"]
            lines.append(f"| {method} | {rin:.1f} | {rsrv:.1f} | {rsrv / rin:.3f} | "
                         f"{statistics.median(first['in']):.0f} | {statistics.median(first['srv']):.0f} |")
            print(lines[-1], flush=True)
        finally:
            srv.stop()
    lines += ["", f"Machine: {os.cpu_count()} cores; python {sys.version.split()[0]}; OMP_WAIT_POLICY="
              f"{os.environ['OMP_WAIT_POLICY']}. First-token times are medians over the prompts (streamed, the prompt's "
              "prefill included)."]
    out = Path(a.out) / f"serve_{a.model.replace('/', '_')}_{time.strftime('%Y%m%d-%H%M%S')}.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
