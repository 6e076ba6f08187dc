"""The CPU runtime itself: pass costs and autoregressive speed per matmul path and weight format, against HF.

    python -m bench.runtime --model smollm2-135m --prompts 4 --max-new-tokens 64

Configurations (one process, measurements interleaved so machine noise hits them alike):
- ``torch-fp32``: float32 weights, torch's matmul (the runtime before kernels/cpu/cpu_linear.cpp; SWIFTK_CPU_KERNELS=0)
- ``linear-fp32``: float32 weights, swiftk's CPU matmul kernel, the other ops of each layer one by one in torch
  (the runtime before kernels/cpu/cpu_decode.cpp; ``cpu_layers.set_fused(False)``)
- ``kernel-fp32``: float32 weights, the fused C layer loop (kernels/cpu/cpu_decode.cpp) with swiftk's CPU matmul
  kernel (the default)
- ``kernel-wbf16`` / ``kernel-wint8``: ``weights="bfloat16"`` / ``"int8"`` (rounded target models, opt-in)
- ``kernel-native-f32``: ``weights="native", activations="float32"``: the GGUF file's own blocks with float32
  activations (kernels/cpu/cpu_quant.cpp in the fused loop), the exact de-quantized model
- ``kernel-native``: the default for a quantized GGUF file: its blocks with int8 activations (kernels/cpu/cpu_qdot.cpp),
  integer dot products as llama.cpp computes

Part 1, pass costs: a decode step (ms, and weight bytes / step time against the measured read bandwidth = roofline
share), verify passes of 4/8/16 tokens and a draft step with 45% of the sublayers skipped, both in decode steps,
next to the share of bytes that draft step reads, and the same draft step with the reduced-vocabulary draft head
``generate`` uses (``draft_vocab`` frequent tokens plus the context's), and a ``--prefill``-token prefill (the
time to first token) per configuration and for llama.cpp. Part 2: greedy ``generate`` tok/s of each configuration
and of HF transformers ``generate`` (float32, the same GGUF) on the same prompts, with token identity against HF, and of
llama.cpp on the same GGUF file when llama-cpp-python is installed (benchlib/llamacpp.py; ``--no-llamacpp`` leaves it
out): it runs the file's quantized blocks, so its ratio is the one to hold the opt-in ``int8`` format against.
Writes ``runtime_<model>_<device>_<date>.json`` and ``.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

from benchlib.machine import read_bandwidth
from swiftk.atomic import write_atomic
from swiftk.errors import SwiftkError

CONFIGS = ("torch-fp32", "linear-fp32", "kernel-fp32", "kernel-wbf16", "kernel-wint8", "kernel-native-f32",
           "kernel-native")
WEIGHTS = {"torch-fp32": None, "linear-fp32": None, "kernel-fp32": None, "kernel-wbf16": "bfloat16",
           "kernel-wint8": "int8", "kernel-native-f32": "native", "kernel-native": "native"}
ACTS = {"kernel-native-f32": "float32", "kernel-native": "int8"}


def use(config: str) -> None:
    """Switch this process's CPU paths to ``config``'s (the three float32 configurations share one engine)."""
    from swiftk.runtime.ops import cpu_layers, native

    native.set_enabled(config != "torch-fp32")
    cpu_layers.set_fused(config not in ("torch-fp32", "linear-fp32"))


def _time(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def draft_skip(model, share: float = 0.45) -> torch.Tensor:
    """A fixed draft: every other eligible sublayer from the middle out until ``share`` of all are skipped."""
    from swiftk.runtime import skipset

    n = model.cfg.n_sublayers
    elig = list(skipset.eligible(model.cfg.n_layers))
    elig.sort(key=lambda i: abs(i - n / 2))
    skip = torch.zeros(n, dtype=torch.bool)
    for i in elig[::2] + elig[1::2]:
        if skip.sum() >= round(share * n):
            break
        skip[i] = True
    return skip


def pass_costs(engines: dict, reps: int, verify=(4, 8, 16), ctx: int = 128) -> dict:
    """Pass costs with ``ctx`` tokens already in the cache (a verify pass's attention grows with it)."""
    from swiftk.runtime.model import nbytes

    out = {c: {} for c in engines}
    skip = draft_skip(next(iter(engines.values())).model)
    for c, eng in engines.items():
        m = eng.model
        cache = eng.cache
        use(c)
        m.forward(torch.arange(ctx) % 1000 + 100, torch.arange(ctx), torch.arange(ctx), cache)
        cache.reset()
        cache.advance(ctx)
        use("kernel-fp32")
    # the reduced-vocabulary draft head as generate builds it (DecodeConfig.draft_vocab frequent tokens + context)
    from swiftk.options import DecodeConfig

    heads = {}
    for c, eng in engines.items():
        h = eng.draft_head(DecodeConfig().draft_vocab)
        h.add((torch.arange(ctx) % 1000 + 100).tolist())
        heads[c] = h.logits_full
    shapes = {"step": (1, None), **{f"verify{T}": (T, None) for T in verify}, "draft": (1, skip), "draft_vh": (1, skip)}
    best = {(c, k): float("inf") for c in engines for k in shapes}
    for r in range(reps):
        for k, (T, sk) in shapes.items():
            ids, pos = torch.full((T,), 5), torch.arange(ctx, ctx + T)
            for c, eng in engines.items():
                use(c)
                hd = heads[c] if k == "draft_vh" else None
                dt = _time(lambda: eng.model.forward(ids, pos, pos, eng.cache, skip=sk, head=hd))
                if r:  # the first rep warms up
                    best[(c, k)] = min(best[(c, k)], dt)
    use("kernel-fp32")
    for c, eng in engines.items():
        m = eng.model
        step = best[(c, "step")]
        sub_bytes = [sum(nbytes(t) for t in ws) for L in m.layers                  # attention, MLP per layer
                     for ws in ((L.wqkv, L.wo), (L.w_gate_up, L.w_down))]
        skipped = sum(b for b, s in zip(sub_bytes, skip.tolist()) if s)
        out[c] = {"weight_mb": m.weight_bytes() / 1e6, "step_ms": step * 1e3,
                  "weight_gb_s": m.weight_bytes() / step / 1e9,
                  **{k: best[(c, k)] / step for k in shapes if k != "step"},
                  "draft_bytes_share": 1 - skipped / m.weight_bytes(), "draft_skipped": int(skip.sum())}
    return out


def prefill_costs(engines: dict, llm, P: int, reps: int = 2) -> dict:
    """Seconds (best of ``reps``) of a ``P``-token prefill with logits for the last token (what generate runs), per
    configuration (the fused ones also op by op in torch, as ``NAME op by op``: the C loop's gain) and for llama.cpp
    (``Llama.eval``, its own batching) when given: the time to first token."""
    from swiftk.runtime.ops import cpu_layers

    ids = torch.arange(P) % 1000 + 100
    best = {}
    for c, eng in engines.items():
        for name, fused in ((c, None), *([(f"{c} op by op", False)] if c.startswith("kernel") else [])):
            use(c)
            if fused is not None:
                cpu_layers.set_fused(fused)
            cache = eng.model.new_cache(P + 8)
            for r in range(reps):
                cache.reset()
                dt = _time(lambda: eng.model.forward(ids, torch.arange(P), torch.arange(P), cache,
                                                     logits_idx=torch.tensor([P - 1])))
                best[name] = min(best.get(name, float("inf")), dt)
        use("kernel-fp32")
    if llm is not None:
        for r in range(reps):
            llm.reset()
            best["llama.cpp"] = min(best.get("llama.cpp", float("inf")), _time(lambda: llm.eval(ids.tolist())))
        llm.reset()
    return best


def main(argv=None) -> int:
    from benchlib.machine import device_kind, set_threads
    from benchlib.prompts import build_prompts, first_diff
    from bench.e2e import _hf_run, _swiftk_run, load_pair

    ap = argparse.ArgumentParser(prog="python -m bench.runtime", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="humaneval", choices=["humaneval", "mtbench"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=12, help="repetitions of each pass timing (min is kept)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-llamacpp", action="store_true", help="leave out the llama.cpp peer even if installed")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prefill", type=int, default=512, help="tokens of the prefill timing (0: leave it out)")
    ap.add_argument("--verify", default="4,8,16", help="verify pass sizes to time, in decode steps (4,8,16 shown)")
    ap.add_argument("--contexts", default="128", help="tokens in the cache during the pass timings; the first one "
                    "fills the main table, several add a table of step ms and verify passes per context")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    configs = [c for c in a.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs or a.prompts < 1 or a.max_new_tokens < 1 or a.reps < 2:
        ap.error(f"--configs from {', '.join(CONFIGS)}; --prompts/--max-new-tokens >= 1, --reps >= 2")
    import swiftk
    from swiftk.runtime.ops import cpu_linear
    from swiftk.loading.registry import resolve_model

    try:
        threads = set_threads(a.threads)
        if not cpu_linear.available() and any(c.startswith("kernel") for c in configs):
            raise SwiftkError(f"CPU kernel unavailable: {cpu_linear.status()}")
        base, hf, why = load_pair(a.model, "cpu", "float32", need_hf=not a.no_hf, weights="float32")
        engines = {c: base if WEIGHTS[c] is None else swiftk.load(a.model, weights=WEIGHTS[c], activations=ACTS.get(c),
                                                                  persist=False)
                   for c in configs}   # the float32 configurations share one engine
        for eng in {id(e): e for e in engines.values()}.values():
            eng.corpus(wait=True)   # no corpus build runs beside a timing
        from swiftk.runtime import model as model_mod

        model_mod.choose_cpu_linear_forms(base.model.layers[0].w_gate_up)   # torch-fp32's product forms
        items = build_prompts(base, [a.workload], a.prompts, a.prompts)[a.workload]
        gguf = resolve_model(a.model)
        llm, llm_why = None, "--no-llamacpp"
        if not a.no_llamacpp:
            from benchlib.llamacpp import load_llamacpp

            llm, llm_why = (None, "not a GGUF file") if gguf.is_dir() else load_llamacpp(gguf, threads)
    except SwiftkError as e:
        print(f"bench.runtime: error: {e}", file=sys.stderr)
        return 2

    bw = read_bandwidth()
    print(f"# {a.model} cpu threads={threads} {platform.processor() or platform.machine()}; read bandwidth "
          f"{bw:.1f} GB/s (before the pass timings); linear: {cpu_linear.status()}")
    verify = sorted({int(v) for v in a.verify.split(",") if v.strip()} | {4, 8, 16})
    contexts = [int(c) for c in a.contexts.split(",") if c.strip()]
    by_ctx = {ctx: pass_costs(engines, a.reps, verify, ctx) for ctx in contexts}
    costs = by_ctx[contexts[0]]
    bw = max(bw, read_bandwidth())   # measured twice: one noisy burst must not inflate every roofline share
    lines = [f"| config | weights MB | step ms | GB/s (roofline share) | verify 4 | verify 8 | verify 16 | "
             f"draft ({costs[configs[0]]['draft_skipped']} skipped) | draft bytes share | draft, reduced head | "
             "reduced / full-head draft |", "|---" * 11 + "|"]
    for c in configs:
        r = costs[c]
        lines.append(f"| {c} | {r['weight_mb']:.0f} | {r['step_ms']:.1f} | {r['weight_gb_s']:.1f} "
                     f"({r['weight_gb_s'] / bw:.0%}) | {r['verify4']:.2f} | {r['verify8']:.2f} | "
                     f"{r['verify16']:.2f} | {r['draft']:.2f} | {r['draft_bytes_share']:.2f} | "
                     f"{r['draft_vh']:.2f} | {r['draft_vh'] / r['draft']:.2f} |")
    if verify != [4, 8, 16]:
        vl = ["| config | " + " | ".join(f"v({T})" for T in verify) + " |", "|---" * (len(verify) + 1) + "|"]
        vl += [f"| {c} | " + " | ".join(f"{costs[c][f'verify{T}']:.2f}" for T in verify) + " |" for c in configs]
        lines += [""] + vl
    if len(contexts) > 1:
        cl = ["| config | context | step ms | " + " | ".join(f"v({T})" for T in verify) + " |",
              "|---" * (len(verify) + 3) + "|"]
        cl += [f"| {c} | {ctx} | {by_ctx[ctx][c]['step_ms']:.2f} | "
               + " | ".join(f"{by_ctx[ctx][c][f'verify{T}']:.2f}" for T in verify) + " |"
               for c in configs for ctx in contexts]
        lines += [""] + cl
    print("\n".join(lines))
    pre = prefill_costs(engines, llm, a.prefill) if a.prefill else {}
    if pre:
        pl = [f"| prefill {a.prefill} tokens | " + " | ".join(pre) + " |", "|---" * (len(pre) + 1) + "|",
              "| ms | " + " | ".join(f"{v * 1e3:.0f}" for v in pre.values()) + " |"]
        print("\n".join(pl))
        lines += [""] + pl

    # Part 2: generate, interleaved per prompt (rotating order).
    who = configs + ([] if hf is None else ["hf-fp32"]) + ([] if llm is None else ["llama.cpp"])
    if llm is None:
        print(f"# llama.cpp peer left out: {llm_why}")
    tot = {w: [0, 0.0] for w in who}
    same = {w: 0 for w in who}
    same_fp32 = {w: 0 for w in who}   # native and llama.cpp: the file's model, float32 summation in another order
    for eng in engines.values():
        _swiftk_run(eng, items[0]["ids"], 8)
    if hf is not None:
        _hf_run(hf, items[0]["ids"], 8, "greedy")
    if llm is not None:
        from benchlib.llamacpp import llamacpp_run

        llamacpp_run(llm, items[0]["ids"], 8, base.tokenizer.eos_ids)
    for i, it in enumerate(items):
        order = who[i % len(who):] + who[:i % len(who)]
        got = {}
        for w in order:
            if w == "hf-fp32":
                got[w] = _hf_run(hf, it["ids"], a.max_new_tokens, "greedy")
            elif w == "llama.cpp":
                got[w] = llamacpp_run(llm, it["ids"], a.max_new_tokens, base.tokenizer.eos_ids)
            else:
                use(w)
                got[w] = _swiftk_run(engines[w], it["ids"], a.max_new_tokens)
                use("kernel-fp32")
            tot[w][0] += got[w]["new_tokens"]
            tot[w][1] += got[w]["wall_time_s"]
        ref = got.get("hf-fp32")
        for w in who:
            if ref is not None and first_diff(got[w]["token_ids"], ref["token_ids"]) is None:
                same[w] += 1
            if "kernel-fp32" in got and first_diff(got[w]["token_ids"], got["kernel-fp32"]["token_ids"]) is None:
                same_fp32[w] += 1
    tps = {w: tot[w][0] / tot[w][1] for w in who}
    gl = ["| config | tok/s | vs torch-fp32 | vs kernel-fp32 | vs HF fp32 | vs llama.cpp | prompts identical to HF | "
          "to kernel-fp32 |", "|---|---|---|---|---|---|---|---|"]
    for w in who:
        vs = [f"{tps[w] / tps[r]:.2f}x" if r in tps else "-"
              for r in ("torch-fp32", "kernel-fp32", "hf-fp32", "llama.cpp")]
        gl.append(f"| {w} | {tps[w]:.1f} | {' | '.join(vs)} | {same[w] if hf is not None else '-'}/{len(items)} | "
                  f"{same_fp32[w] if 'kernel-fp32' in who else '-'}/{len(items)} |")
    print("\n".join(gl))

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base_name = Path(a.out) / f"runtime_{a.model}_{device_kind('cpu')}_{stamp}"
    summary = {"model": a.model, "date": stamp, "threads": threads, "cpu": platform.processor(),
               "read_bandwidth_gb_s": bw, "linear": cpu_linear.status(), "workload": a.workload,
               "prompts": len(items), "max_new_tokens": a.max_new_tokens, "pass_costs": costs,
               "pass_costs_by_context": {str(k): v for k, v in by_ctx.items()},
               "prefill_s": pre, "prefill_tokens": a.prefill,
               "generate_tok_s": tps, "identical_to_hf": same if hf is not None else None,
               "identical_to_kernel_fp32": same_fp32 if "kernel-fp32" in who else None,
               "resident_weight_bytes": {c: engines[c].info()["resident_weight_bytes"] for c in configs},
               "gguf_bytes": gguf.stat().st_size if gguf.is_file() else None,
               "llamacpp": None if llm is None else {"version": _llamacpp_version(), "gguf": str(gguf)},
               "llamacpp_missing": llm_why if llm is None else None,
               "command": "python -m bench.runtime " + " ".join(argv if argv is not None else sys.argv[1:])}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    write_atomic(str(base_name) + ".json", json.dumps(summary, indent=1))
    write_atomic(str(base_name) + ".md", f"# bench.runtime {a.model} ({stamp}, {threads} threads, read bandwidth "
                 f"{bw:.1f} GB/s)\n\n`{summary['command']}`\n\n" + "\n".join(lines) + "\n\n" + "\n".join(gl) + "\n")
    print(f"wrote {base_name}.json/.md")
    return 0


def _llamacpp_version() -> str:
    from importlib.metadata import version

    return version("llama-cpp-python")


if __name__ == "__main__":
    raise SystemExit(main())
