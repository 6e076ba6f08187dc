"""How far int8 activations move a model from the exact de-quantized one: top-1 agreement, KL divergence and the
perplexity of both, teacher-forced on held-out text, per model.

    python -m bench.quality --model smollm2-135m [--positions 2000]

Both engines load the same GGUF file (``weights="native"``): ``activations="int8"`` (the CPU default,
kernels/cpu/cpu_qdot.cpp) against ``activations="float32"`` (kernels/cpu/cpu_quant.cpp: exactly the de-quantized model).
Texts, none of them used to build or tune the drafts: ``code``, HumanEval's prompt + canonical solution from problem
100 on; ``chat``, MT-Bench's questions (both turns) through the model's chat template, from the last question of
each category backwards. Each text runs in passes of up to 64 tokens after the ones before it (the passes a verify
round makes), until ``--positions`` predicted tokens per kind. Writes ``quality_<model>_<date>.json`` / ``.md``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import sys
from pathlib import Path

import torch

from swiftk.atomic import write_atomic

PASS = 64   # tokens per pass: the largest verify pass, so every logit comes from the same path as a verify round


def texts(kind: str, tok, chat_template) -> list:
    """Token id lists of the held-out texts of ``kind`` ("code" or "chat")."""
    from benchlib import workloads

    if kind == "code":
        probs = list(workloads._problems().values())[100:]
        return [tok.encode(p["prompt"] + p["canonical_solution"]) for p in probs]
    items = workloads.mtbench()
    by_cat: dict = {}
    for it in items:
        by_cat.setdefault(it["category"], []).append(it)
    out = []
    for i in range(max(len(v) for v in by_cat.values())):
        for cat in sorted(by_cat):
            qs = by_cat[cat]
            if i < len(qs):
                for turn in qs[-1 - i]["turns"]:
                    out.append(chat_template([{"role": "user", "content": turn}]))
    return out


@torch.inference_mode()
def logprobs(eng, ids: list) -> torch.Tensor:
    """[len(ids) - 1, vocab] log-softmax of the model's next-token logits at each position, in passes of PASS."""
    m = eng.model
    cache = m.new_cache(len(ids) + 8)
    out = []
    for a in range(0, len(ids) - 1, PASS):
        b = min(a + PASS, len(ids) - 1)
        pos = torch.arange(a, b)
        out.append(m.forward(torch.tensor(ids[a:b]), pos, pos, cache).float().log_softmax(-1))
    return torch.cat(out)


def compare(ref, test, token_lists: list, positions: int) -> dict:
    """Top-1 agreement, mean KL(ref || test), and both perplexities over up to ``positions`` predicted tokens."""
    n = agree = 0
    kl = nll_ref = nll_test = 0.0
    for ids in token_lists:
        if n >= positions:
            break
        ids = ids[: positions - n + 1]
        if len(ids) < 2:
            continue
        lr, lt = logprobs(ref, ids), logprobs(test, ids)
        target = torch.tensor(ids[1:])
        agree += int((lr.argmax(-1) == lt.argmax(-1)).sum())
        kl += float((lr.exp() * (lr - lt)).sum())
        nll_ref -= float(lr.gather(1, target[:, None]).sum())
        nll_test -= float(lt.gather(1, target[:, None]).sum())
        n += len(ids) - 1
    return {"positions": n, "top1_agreement": agree / n, "kl_mean": kl / n, "ppl_float32": math.exp(nll_ref / n),
            "ppl_int8": math.exp(nll_test / n), "ppl_change": math.exp((nll_test - nll_ref) / n) - 1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--positions", type=int, default=2000, help="predicted tokens per kind of text")
    ap.add_argument("--kinds", default="code,chat")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    import swiftk
    from swiftk.runtime.ops import cpu_quant

    if a.threads:
        torch.set_num_threads(a.threads)
    ref = swiftk.load(a.model, weights="native", activations="float32", persist=False)
    test = swiftk.load(a.model, weights="native", activations="int8", persist=False)
    tok = ref.tokenizer

    def template(msgs):
        return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=False))

    rows = {}
    for kind in a.kinds.split(","):
        rows[kind] = compare(ref, test, texts(kind, tok, template), a.positions)
        r = rows[kind]
        print(f"{a.model} {kind}: {r['positions']} positions, top-1 agreement {100 * r['top1_agreement']:.2f}%, "
              f"KL {r['kl_mean']:.2e}, perplexity float32 {r['ppl_float32']:.3f} int8 {r['ppl_int8']:.3f} "
              f"({100 * r['ppl_change']:+.2f}%)", flush=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta = {"model": a.model, "date": stamp, "cpu": platform.processor() or platform.machine(),
            "int8_kernel": cpu_quant.status(), "arithmetic": test.info()["arithmetic"],
            "command": "python -m bench.quality " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"quality_{a.model}_{stamp}"
    write_atomic(f"{base}.json", json.dumps({"meta": meta, "results": rows}, indent=1))
    md = [f"# int8 vs float32 activations, {a.model} ({stamp})", "", f"`{meta['command']}`; {meta['arithmetic']}", "",
          "| text | positions | top-1 agreement | KL(float32 ‖ int8) | perplexity float32 | perplexity int8 "
          "| change |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for kind, r in rows.items():
        md.append(f"| {kind} | {r['positions']} | {100 * r['top1_agreement']:.2f}% | {r['kl_mean']:.2e} | "
                  f"{r['ppl_float32']:.3f} | {r['ppl_int8']:.3f} | {100 * r['ppl_change']:+.2f}% |")
    write_atomic(f"{base}.md", "\n".join(md) + "\n")
    print(f"wrote {base}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
