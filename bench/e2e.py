"""End-to-end comparison: swiftk (autoregressive, SWIFT cold / warm / saved skip set) against Hugging Face
transformers (greedy, early exit, prompt lookup) on the same GGUF weights, prompts and machine, in one process.

    python -m bench.e2e --model smollm2-135m --workload humaneval,mtbench --n 8 --max-new-tokens 128

Methods run interleaved per prompt (the order rotates from prompt to prompt) so machine noise hits them alike.
Every method is greedy; its token ids are compared with HF greedy on the same prompt ids and every difference is
printed as ``MISMATCH method prompt first-diff-index`` (``--strict``: exit code 1).

SWIFT variants (one engine; each variant owns a ``SkipSetState`` passed to ``generate(..., state=)``):

- ``swift-cold``: the default ``generate`` from a cold start: a fresh learned state and a fresh cost model at the
  start of each workload (nothing persisted is read), optimization time included, state carried across the
  workload's prompts as a user's session would (the outputs it decoded draft for its later prompts: ``history``).
- ``swift-nohist``: the same with ``history=False`` (the A/B of the session-history drafts).
- ``swift-paper``: the paper's rules from a cold state: draft every round (eps 0.8, fixed tree budget), matchness
  objective at r = 0.45, optimize on every round, layer drafts only (no n-gram, history or corpus drafts); the
  baseline the speed-aware loop replaced.
- ``swift-warm``: a tuning pass (fresh optimizer, SWIFT over the same prompts, run before the measured pass) saves
  its best skip set; the measured pass loads it (``eng.states.load_skip_set``) and does not optimize.
- ``swift-saved``: the skip set from ``--skip-set FILE``, no optimization. With a file from ``swiftk optimize`` run
  on another task this is the Self-SD static comparison (a set found offline on one task, applied to others).

Other swiftk drafting modes: ``swiftk-ee<E>`` = early-exit draft (layers 0..E-1 + LM head) with the KVQ cache
(``swiftk-ee`` expands to one per ``--early-exit`` layer, like ``hf-ee``); ``swiftk-ngram`` = method "ngram" (prompt
lookup plus the corpus n-grams of swiftk/proposers/datastore.py), ``swiftk-pld`` = the same with the corpus off (prompt lookup
alone inside swiftk). Every swiftk arm but autoregressive owns a learned state, fresh at the start of each workload:
an arm's earlier outputs draft for its later prompts (as in a user's session), never for another arm's, and no
state sees a measured prompt before it is measured.

Writes under ``--out`` (file names carry model, dtype, device kind and date): ``*.samples.jsonl`` (Spec-Bench
fields + ours), ``*.summary.json``, ``*.md`` (the tables printed at the end) and plots (``bench.plots``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path

import torch

from swiftk.atomic import write_atomic as atomic_write
from swiftk.errors import SwiftkError
from swiftk.moa.method import drafter_path, load_drafter  # noqa: F401
from benchlib.machine import copy_bandwidth, device_kind, machine_info, peak_rss_mb, set_threads, sync
from benchlib.prompts import WORKLOAD_NAMES, build_prompts, first_diff

AR, COLD, WARM, SAVED, PAPER, NGRAM, MOA = "swiftk-ar", "swift-cold", "swift-warm", "swift-saved", "swift-paper", \
    "swiftk-ngram", "swiftk-moa"
PLD = "swiftk-pld"   # method "ngram" with the corpus n-grams off: prompt lookup alone (the datastore's A/B)
NOHIST = "swift-nohist"   # swift-cold with history=False: the earlier outputs' n-grams off (the history's A/B)
HF_GREEDY, HF_PLD = "hf-greedy", "hf-pld"
AR_EAGER = "swiftk-ar-eager"   # autoregressive with the CUDA graphs off (CUDA only: the same as swiftk-ar elsewhere)
SWIFT_METHODS = (COLD, NOHIST, WARM, SAVED, PAPER)
PAPER_OPTIONS = {"speculate": "always", "ngram": False, "history": False, "datastore": False}   # layer drafts only
DEFAULT_METHODS = (HF_GREEDY, AR, AR_EAGER, COLD, NOHIST, WARM, SAVED, PAPER, NGRAM, PLD, MOA, "swiftk-ee", "hf-ee",
                   HF_PLD)  # "*-ee": one per E
# swiftk-moa: one row per --drafter [LABEL=]PATH (swiftk-moa-LABEL), or the model's own drafter when none is given


def load_pair(model: str, device, dtype: str, need_hf: bool = True, weights=None):
    """(swiftk engine, HF model or None, why-HF-is-missing). HF loads the same GGUF file swiftk reads."""
    import swiftk
    from swiftk.loading.registry import resolve_model

    # cold: no state from earlier runs; trace: the per-round lists the tables and plots read
    eng = swiftk.load(model, device=device, dtype=dtype, persist=False, trace=True, weights=weights)
    eng.corpus(wait=True)   # every arm drafts from the same sources; no build runs beside a timing
    hf, why = None, None
    if need_hf:
        from bench.hf_baselines import load_hf

        path = resolve_model(model)
        if path.is_dir():
            why = "HF baselines load GGUF files only"
        else:
            try:
                hf, _ = load_hf(path, dtype=dtype, device=str(device))
            except SwiftkError as e:
                why = str(e)
        if hf is not None:
            # Stop HF on every end-of-sequence id swiftk stops on (GGUF metadata may list several; HF keeps one),
            # otherwise both would be "right" and still differ in length.
            hf.generation_config.eos_token_id = sorted(eng.tokenizer.eos_ids)
    return eng, hf, why


# ---------------------------------------------------------------- methods


def new_state(eng, method, skip_set_file=None):
    """The learned state a SWIFT variant decodes with (and the per-call options that go with it)."""
    if method == PAPER:
        return eng.new_state(objective="matchness", opt_budget=1.0), PAPER_OPTIONS
    if method == NOHIST:
        return eng.new_state(), {"history": False}
    st = eng.new_state()
    if skip_set_file is not None:
        st.use(eng.states.read_skip_set(skip_set_file))
    return st, {}


def _swiftk_run(eng, ids, max_new, state=None, **gen_kw) -> dict:
    """``state``: (SkipSetState, options) of the arm (its own learned state: skip set, acceptance statistics and
    the outputs it decoded, never shared with another arm) with ``gen_kw`` on top (default method "swift"), or
    None for ``gen_kw`` alone (default autoregressive)."""
    dev = eng.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(dev)
    t0 = time.perf_counter()
    if state is None:
        r = eng.generate(ids, max_new_tokens=max_new, prefix_cache=False, **({"method": "autoregressive"} | gen_kw))
    else:   # prefix_cache=False: every arm prefills its prompt whole (the arms run the same prompts in turn)
        r = eng.generate(ids, max_new_tokens=max_new, state=state[0], prefix_cache=False,
                         **({"method": "swift"} | state[1] | gen_kw))
    sync(dev)
    wall = time.perf_counter() - t0
    s = r.stats
    out = {"token_ids": r.token_ids, "text": r.text, "wall_time_s": wall, "new_tokens": len(r.token_ids),
           "finish_reason": r.finish_reason, "decoding_steps": s.get("decoding_steps", len(r.token_ids))}
    out.update(plain_steps=s.plain_steps, accepted_by_source=s.accepted_by_source)
    if s["method"] == "autoregressive":
        out.update(accept_lengths=[1] * max(0, len(r.token_ids) - 1), drafted=0, accepted=0)
    else:
        out.update(accept_lengths=s["accept_lengths"], drafted=s["drafted_tokens"], accepted=s["accepted_tokens"],
                   time_optimize_s=s["time_optimize_s"], time_draft_s=s["time_draft_s"],
                   time_verify_s=s["time_verify_s"], skip_set=s["skip_set"],
                   matchness_history=s["matchness_history"], best_matchness=s["best_matchness"],
                   optimization_done=s["optimization_done"], optimization_steps=s["optimization_steps"],
                   max_tree_nodes=s["max_tree_nodes"], phases=_count(s["phases"]), tree_sizes=s.tree_sizes,
                   longest_bo_stall_ms=s.longest_bo_stall_ms, bo_errors=s.bo_errors,
                   expected_vs_measured=s.expected_vs_measured, costs=s.costs)
    if dev.type == "cuda":
        out["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def _hf_run(hf, ids, max_new, method, **kw) -> dict:
    from bench.hf_baselines import hf_generate

    cuda = next(hf.parameters()).device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    r = hf_generate(hf, ids, max_new, method, **kw)
    r["decoding_steps"] = None  # transformers does not report its verify passes
    if cuda:
        r["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return r


def _ee_layer(m: str) -> int:
    return int(m.rsplit("ee", 1)[1])


def _count(items) -> dict:
    out = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def expand_methods(names, n_layers: int, early_exit, have_skip_set: bool, have_hf: bool, drafters=None):
    """Method names to run, in canonical order, with hf-ee expanded to one method per early-exit layer and
    swiftk-moa to one per drafter label (``drafters``: label -> path; None: no drafter available)."""
    out = []
    for m in names:
        if m in ("hf-ee", "swiftk-ee"):
            out += [f"{m}{e}" for e in early_exit]
        elif m == MOA:
            out += [MOA if lb == "" else f"{MOA}-{lb}" for lb in (drafters or {})]
        elif (m.startswith("hf-ee") and m[5:].isdigit()) or (m.startswith("swiftk-ee") and m[9:].isdigit()):
            out.append(m)
        elif m in (HF_GREEDY, HF_PLD, AR, AR_EAGER, COLD, NOHIST, WARM, SAVED, PAPER, NGRAM, PLD):
            out.append(m)
        else:
            raise SwiftkError(f"unknown method {m!r}; use {', '.join(DEFAULT_METHODS)}, hf-ee<E> or swiftk-ee<E>")
    for m in out:
        if "-ee" in m and not 1 <= _ee_layer(m) < n_layers:
            raise SwiftkError(f"{m}: early-exit layer must be in [1, {n_layers - 1}]")
    if not have_skip_set:
        out = [m for m in out if m != SAVED]
    if not have_hf:
        out = [m for m in out if not m.startswith("hf-")]
    seen = set()
    return [m for m in out if not (m in seen or seen.add(m))]


# ---------------------------------------------------------------- aggregation


def _ratio(a, b):
    return a / b if a and b else None


def aggregate(runs: list, methods: list) -> dict:
    """workload -> group ('all' or a category) -> method -> metrics."""
    out: dict = {}
    for r in runs:
        for g in ("all", r["category"]):
            out.setdefault(r["workload"], {}).setdefault(g, {}).setdefault(r["method"], []).append(r)
    res: dict = {}
    for w, groups in out.items():
        for g, by_m in groups.items():
            cell = res.setdefault(w, {}).setdefault(g, {})
            for m in methods:
                rs = by_m.get(m)
                if not rs:
                    continue
                toks = sum(x["new_tokens"] for x in rs)
                wall = sum(x["wall_time_s"] for x in rs)
                acc = [a for x in rs for a in (x.get("accept_lengths") or [])]
                drafted = sum(x.get("drafted") or 0 for x in rs)
                opt = sum(x.get("time_optimize_s") or 0.0 for x in rs)
                per = sorted(x["new_tokens"] / x["wall_time_s"] for x in rs if x["wall_time_s"] > 0)
                cell[m] = {
                    "prompts": len(rs), "new_tokens": toks, "wall_time_s": wall,
                    "tokens_per_s": toks / wall if wall else None,
                    "tokens_per_s_median_prompt": per[len(per) // 2] if per else None,
                    "M": (sum(acc) / len(acc)) if acc and not m.startswith("hf-") else None,
                    "alpha": (sum(x.get("accepted") or 0 for x in rs) / drafted) if drafted else None,
                    "opt_share": opt / wall if wall and m in SWIFT_METHODS else None,
                    "mismatches_vs_hf": sum(1 for x in rs if x.get("diff_vs_hf") is not None),
                    "mismatches_vs_ar": sum(1 for x in rs if x.get("diff_vs_ar") is not None),
                    "peak_gpu_mem_mb": max((x.get("peak_gpu_mem_mb") or 0 for x in rs), default=0) or None,
                }
                if m != AR and not m.startswith("hf-"):  # the speed-aware loop's own figures
                    steps = sum(x.get("decoding_steps") or 0 for x in rs)
                    trees = [t for x in rs for t in (x.get("tree_sizes") or [])]
                    src = {}
                    for x in rs:
                        for k, v in (x.get("accepted_by_source") or {}).items():
                            src[k] = src.get(k, 0) + v
                    cell[m].update(plain_share=sum(x.get("plain_steps") or 0 for x in rs) / steps if steps else None,
                                   mean_tree=sum(trees) / len(trees) if trees else None, accepted_by_source=src,
                                   longest_bo_stall_ms=max((x.get("longest_bo_stall_ms") or 0 for x in rs),
                                                           default=None))
            for m, c in cell.items():
                c["speedup_vs_hf_greedy"] = _ratio(c["tokens_per_s"], cell.get(HF_GREEDY, {}).get("tokens_per_s"))
                c["speedup_vs_swiftk_ar"] = _ratio(c["tokens_per_s"], cell.get(AR, {}).get("tokens_per_s"))
                best_hf = max((v["tokens_per_s"] or 0 for k, v in cell.items() if k.startswith("hf-")), default=0)
                c["speedup_vs_best_hf"] = _ratio(c["tokens_per_s"], best_hf)
    return res


def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None else fmt.format(x)


def markdown_tables(summary: dict) -> str:
    lines = []
    meta = summary["meta"]
    lines.append(f"### {meta['model']} · {meta['dtype']} · {meta['machine']['device_name']} · "
                 f"{meta['max_new_tokens']} new tokens · greedy · {meta['date']}")
    lines.append("")
    for w, groups in summary["results"].items():
        cell = groups["all"]
        lines.append(f"**{w}** ({next(iter(cell.values()))['prompts']} prompts)")
        lines.append("")
        lines.append("| method | tok/s | × HF greedy | × swiftk AR | × best HF | M | α | opt share | plain | tree | "
                     f"accepted draft/ngram/history/corpus | mismatches vs {meta['reference']} |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for m, c in cell.items():
            lines.append(f"| {m} | {_f(c['tokens_per_s'], '{:.1f}')} | {_f(c['speedup_vs_hf_greedy'])} | "
                         f"{_f(c['speedup_vs_swiftk_ar'])} | {_f(c['speedup_vs_best_hf'])} | {_f(c['M'])} | "
                         f"{_f(c['alpha'])} | {_f(c['opt_share'], '{:.0%}')} | {_f(c.get('plain_share'), '{:.0%}')} | "
                         f"{_f(c.get('mean_tree'), '{:.1f}')} | "
                         + ("/".join(str(c['accepted_by_source'].get(k, 0))
                                     for k in ("draft", "ngram", "history", "datastore"))
                            if c.get("accepted_by_source") else "–") + " | "
                         f"{c['mismatches_vs_hf'] if meta['reference'] != AR else c['mismatches_vs_ar']} |")
        lines.append("")
        cats = [g for g in groups if g != "all"]
        if len(cats) > 1:
            methods = list(cell)
            base, key = (("HF greedy", "speedup_vs_hf_greedy") if HF_GREEDY in cell
                         else ("swiftk AR", "speedup_vs_swiftk_ar"))
            lines.append(f"{w}: speedup vs {base} per category (α of swift-cold in brackets)")
            lines.append("")
            lines.append("| method | " + " | ".join(cats) + " |")
            lines.append("|---|" + "---:|" * len(cats))
            for m in methods:
                row = []
                for g in cats:
                    c = groups[g].get(m, {})
                    s = _f(c.get(key))
                    if m == COLD and c.get("alpha") is not None:
                        s += f" ({c['alpha']:.2f})"
                    row.append(s)
                lines.append(f"| {m} | " + " | ".join(row) + " |")
            lines.append("")
    costs = meta.get("costs")
    if costs and costs.get("step_s"):
        vs = ", ".join(f"v({k}) {v / costs['step_s']:.2f}" for k, v in (costs.get("verify_s") or {}).items())
        lines.append(f"Cost model at the end (in decode steps of {costs['step_s'] * 1e3:.1f} ms): {vs}; draft overhead "
                     f"share {costs['draft_overhead']:.2f}; optimization step "
                     + (f"{costs['opt_step_s'] / costs['step_s']:.2f}" if costs.get("opt_step_s") else "–") + ".")
        lines.append("")
    rf = summary.get("roofline")
    if rf:
        lines.append(f"Roofline: copy bandwidth {rf['copy_bandwidth_gb_s']:.1f} GB/s; swiftk AR reads "
                     + ", ".join(f"{w} {v['ar_weight_gb_s']:.2f} GB/s ({v['fraction_of_copy_bw']:.0%})"
                                 for w, v in rf["workloads"].items()) + " of weights.")
        lines.append("")
    mm = summary["mismatches"]
    lines.append(f"Losslessness: {len(mm)} mismatch(es) vs {summary['meta']['reference']}"
                 + ("" if not mm else ": " + "; ".join(f"{x['method']} {x['prompt']} @{x['first_diff']}" for x in mm)))
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="registry name or .gguf path")
    ap.add_argument("--workload", default="humaneval,mtbench", help="comma list of " + ", ".join(WORKLOAD_NAMES))
    ap.add_argument("--n", type=int, default=8, help="HumanEval prompts, and MT-Bench questions per category")
    ap.add_argument("--n-mtbench", type=int, default=None, help="MT-Bench questions per category (default: --n)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 512 on CUDA, 128 on CPU")
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help="comma list of " + ", ".join(DEFAULT_METHODS) + " (hf-ee = one per --early-exit), hf-ee<E>")
    ap.add_argument("--early-exit", default=None, help="comma list of early-exit layers (default n/2, 3n/4)")
    ap.add_argument("--kvq", type=int, default=1, choices=[0, 1], help="KVQ cache for swiftk-ee (default 1, as swiftk)")
    ap.add_argument("--skip-set", default=None, help="skip set JSON for swift-saved")
    ap.add_argument("--drafter", action="append", default=[], metavar="[LABEL=]PATH",
                    help="MoA drafter for swiftk-moa (repeatable: one swiftk-moa-LABEL row each); default: the "
                    "model's own (swiftk train-drafter)")
    ap.add_argument("--tune-passes", type=int, default=1,
                    help="passes of the tuning run that makes the swift-warm skip set (stops early once optimized)")
    ap.add_argument("--strict", action="store_true", help="exit 1 on any mismatch with HF greedy")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no per-run lines")
    a = ap.parse_args(argv)
    if a.max_new_tokens is None:
        a.max_new_tokens = 512 if torch.device(a.device).type == "cuda" else 128
    if a.max_new_tokens < 1 or a.n < 1 or (a.n_mtbench is not None and a.n_mtbench < 1):
        ap.error("--max-new-tokens, --n and --n-mtbench must be >= 1")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        return run(a)
    except SwiftkError as e:
        print(f"bench.e2e: error: {e}", file=sys.stderr)
        return 2


def run(a) -> int:
    threads = set_threads(a.threads)
    workloads = [w.strip() for w in a.workload.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOAD_NAMES:
            raise SwiftkError(f"unknown workload {w!r}; use {', '.join(WORKLOAD_NAMES)}")
    if a.skip_set and not Path(a.skip_set).is_file():
        raise SwiftkError(f"--skip-set {a.skip_set}: no such file")
    requested = [m.strip() for m in a.methods.split(",") if m.strip()]
    need_hf = any(m.startswith("hf-") for m in requested)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = _dt.datetime.now(_dt.timezone.utc)

    t0 = time.perf_counter()
    eng, hf, hf_why = load_pair(a.model, a.device, a.dtype, need_hf)
    load_s = time.perf_counter() - t0
    if need_hf and hf is None:
        print(f"!! HF baselines unavailable: {hf_why}", file=sys.stderr)
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load_avg > (os.cpu_count() or 1) * 0.5:
        # other processes compete for the cores: OpenMP threads then stall each other (100x+ slowdowns seen)
        print(f"!! machine busy (load {load_avg:.1f} on {os.cpu_count()} cores): timings are unreliable; "
              "--threads 1 suffers least", file=sys.stderr)
    L = eng.config.n_layers
    ee = ([int(x) for x in a.early_exit.split(",")] if a.early_exit else sorted({L // 2, (3 * L) // 4}))
    drafters = _drafters(eng, a.drafter) if MOA in requested else {}
    methods = expand_methods(requested, L, ee, bool(a.skip_set), hf is not None, drafters)
    if eng.model.graphs is None:
        methods = [m for m in methods if m != AR_EAGER]   # no graphs to set aside: it would be swiftk-ar again
    reference = HF_GREEDY if HF_GREEDY in methods else (AR if AR in methods else None)
    dev = eng.device
    tag = f"{eng.identity.get('name') or Path(a.model).stem}_{a.dtype}_{device_kind(dev)}_{date:%Y%m%d-%H%M%S}"
    print(f"# {tag}: {len(methods)} methods: {', '.join(methods)}; threads={threads}; load {load_s:.1f}s")

    prompts = build_prompts(eng, workloads, a.n, a.n_mtbench or a.n, a.max_new_tokens)

    # Warm-up: first calls pay one-off costs (allocations, lazy imports, the SWIFT tree budget measurement).
    wid = prompts[workloads[0]][0]["ids"]

    def fresh():
        return eng.new_state(), {}

    _swiftk_run(eng, wid, 8)
    if any(m in SWIFT_METHODS or m.startswith("swiftk-ee") for m in methods):
        _swiftk_run(eng, wid, 16, new_state(eng, COLD))
        print(f"# cost model after warm-up: {json.dumps(eng.costs.to_dict())}")
    for m in methods:   # (throwaway states: an arm's measured state must not have seen a measured prompt)
        if m.startswith("swiftk-ee"):
            _swiftk_run(eng, wid, 8, fresh(), method="early_exit", exit_layer=_ee_layer(m), kvq=bool(a.kvq))
        elif m == NGRAM:
            _swiftk_run(eng, wid, 8, fresh(), method="ngram")
        elif m == PLD:
            _swiftk_run(eng, wid, 8, fresh(), method="ngram", datastore=False)
        elif m.startswith(MOA):
            _moa_run(eng, drafters, m, wid, 8, fresh())
    hf_dead: dict = {}
    for m in methods:
        if m.startswith("hf-"):
            try:
                _hf_call(hf, wid, 8, m)
            except SwiftkError as e:  # HFMethodUnsupported: report n/a, keep going
                hf_dead[m] = str(e)
                print(f"!! {m} n/a: {e}", file=sys.stderr)
    methods = [m for m in methods if m not in hf_dead]

    runs, mismatches, tuning = [], [], {}
    for w in workloads:
        items = prompts[w]
        states = {}
        if WARM in methods:
            tuning[w] = _tune(eng, items, a.max_new_tokens, a.tune_passes, out_dir / f"{tag}_{w}.skipset.json")
            print(f"# {w}: tuned skip set in {tuning[w]['wall_time_s']:.1f}s, {tuning[w]['optimization_steps']} "
                  f"steps, matchness {_f(tuning[w]['best_matchness'])} -> {tuning[w]['file']}")
            states[WARM] = new_state(eng, WARM, tuning[w]["file"])
        if SAVED in methods:
            states[SAVED] = new_state(eng, SAVED, a.skip_set)
        for m in methods:
            if m in (COLD, NOHIST, PAPER):
                states[m] = new_state(eng, m)  # fresh at the start of each workload's stream
            elif m in (NGRAM, PLD) or m.startswith(MOA) or m.startswith("swiftk-ee"):
                states[m] = fresh()            # likewise: the outputs an arm decoded draft only for that arm
        for i, it in enumerate(items):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            got = {}
            for m in order:
                if m.startswith("hf-"):
                    r = _hf_call(hf, it["ids"], a.max_new_tokens, m)
                    r["text"] = eng.tokenizer.decode(r["token_ids"])
                elif m.startswith("swiftk-ee"):
                    r = _swiftk_run(eng, it["ids"], a.max_new_tokens, states[m], method="early_exit",
                                    exit_layer=_ee_layer(m), kvq=bool(a.kvq))
                elif m == NGRAM:
                    r = _swiftk_run(eng, it["ids"], a.max_new_tokens, states[m], method="ngram")
                elif m == PLD:
                    r = _swiftk_run(eng, it["ids"], a.max_new_tokens, states[m], method="ngram", datastore=False)
                elif m.startswith(MOA):
                    r = _moa_run(eng, drafters, m, it["ids"], a.max_new_tokens, states[m])
                elif m == AR_EAGER:
                    r = _eager_run(eng, it["ids"], a.max_new_tokens)
                else:
                    r = _swiftk_run(eng, it["ids"], a.max_new_tokens, states.get(m))
                r.update(method=m, workload=w, prompt_id=it["id"], category=it["category"], stream_index=i)
                got[m] = r
            for m, r in got.items():
                if reference and m != reference:
                    r["diff_vs_hf"] = first_diff(r["token_ids"], got[reference]["token_ids"])
                    if r["diff_vs_hf"] is not None:
                        mismatches.append({"method": m, "workload": w, "prompt": it["id"],
                                           "first_diff": r["diff_vs_hf"], "reference": reference})
                        print(f"MISMATCH {m} {it['id']} {r['diff_vs_hf']} (vs {reference})", file=sys.stderr)
                if AR in got and m != AR:
                    r["diff_vs_ar"] = first_diff(r["token_ids"], got[AR]["token_ids"])
                runs.append(r)
            if not a.quiet:
                print(f"{w} {i + 1}/{len(items)} {it['id']}: " + "  ".join(
                    f"{m} {got[m]['new_tokens'] / max(got[m]['wall_time_s'], 1e-9):.1f}" for m in methods) + " tok/s")

    results = aggregate(runs, methods)
    roofline = _roofline(eng, results, dev)
    summary = {
        "meta": {"tag": tag, "model": eng.identity.get("name") or a.model, "model_identity": eng.identity,
                 "dtype": a.dtype, "device_kind": device_kind(dev), "date": date.isoformat(timespec="seconds"),
                 "max_new_tokens": a.max_new_tokens, "workloads": workloads, "n": a.n,
                 "n_mtbench": a.n_mtbench or a.n, "methods": methods, "unavailable": {**hf_dead,
                 **({"hf-*": hf_why} if need_hf and hf is None else {})}, "early_exit_layers": ee,
                 "reference": reference, "command": "python -m bench.e2e " + " ".join(sys.argv[1:]),
                 "machine": machine_info(dev, threads), "swiftk": {k: v for k, v in eng.info().items()
                                                                  if k in ("weight_bytes", "kv_cache_bytes",
                                                                           "parameters", "backends", "layer_loop",
                                                                           "linear")},
                 "decode_config": eng.info()["decode_config"], "optimizer_config": eng.info()["optimizer_config"],
                 "costs": eng.costs.to_dict(), "load_time_s": load_s,
                 "peak_rss_mb": peak_rss_mb(), "skip_set_file": a.skip_set, "load_average_at_start": load_avg},
        "results": results, "tuning": tuning, "roofline": roofline, "mismatches": mismatches,
    }
    paths = write_outputs(out_dir, tag, summary, runs, plots=not a.no_plots)
    print()
    print(markdown_tables(summary))
    print("wrote " + ", ".join(str(p) for p in paths))
    if mismatches:
        print(f"!! {len(mismatches)} MISMATCH(ES) vs {reference}", file=sys.stderr)
    return 1 if (a.strict and mismatches) else 0


def _drafters(eng, specs) -> dict:
    """--drafter [LABEL=]PATH list -> {label: path}; none given: {"": the model's own} when it has one."""
    out = {}
    for s in specs:
        label, _, path = s.rpartition("=") if "=" in s else ("", "", s)
        if not Path(path).is_file():
            raise SwiftkError(f"--drafter {s}: no such file")
        out[label] = path
    if not out:
        p = drafter_path(eng.target)
        if p.is_file():
            out[""] = str(p)
        else:
            print(f"!! swiftk-moa n/a: no drafter at {p} (swiftk train-drafter)", file=sys.stderr)
    return out


def _eager_run(eng, ids, max_new) -> dict:
    """Autoregressive with the engine's CUDA graphs set aside for this call."""
    graphs, eng.model.graphs = eng.model.graphs, None
    try:
        return _swiftk_run(eng, ids, max_new)
    finally:
        eng.model.graphs = graphs


def _moa_run(eng, drafters, m, ids, max_new, state) -> dict:
    """One swiftk-moa run with the drafter of its label (loaded before the clock starts)."""
    path = drafters[m[len(MOA) + 1:]]
    if (eng.info()["drafter"] or {}).get("path") != path:
        load_drafter(eng.target, path)
    info = eng.info()["drafter"]
    r = _swiftk_run(eng, ids, max_new, state, method="moa")
    r["drafter"] = {k: info[k] for k in ("tli", "lsa", "parameters")}
    return r


def _hf_call(hf, ids, max_new, m) -> dict:
    """Run HF method ``m`` (hf-greedy, hf-pld, hf-ee<E>) on one prompt."""
    if m == HF_GREEDY:
        return _hf_run(hf, ids, max_new, "greedy")
    if m == HF_PLD:
        return _hf_run(hf, ids, max_new, "prompt_lookup")
    return _hf_run(hf, ids, max_new, "early_exit", early_exit_layers=_ee_layer(m))


def _tune(eng, items, max_new, passes, path) -> dict:
    """Fresh optimizer, SWIFT over the workload (up to ``passes`` times, until optimization ends); save the set."""
    st, opts = new_state(eng, COLD)
    t = time.perf_counter()
    for _ in range(max(1, passes)):
        for it in items:
            eng.generate(it["ids"], max_new_tokens=max_new, state=st, **opts)
            if st.optimizer.done:
                break
        if st.optimizer.done:
            break
    wall = time.perf_counter() - t
    eng.states.save_skip_set(path, st.skip_set, matchness=st.optimizer.best_matchness)
    score = st.optimizer.best_matchness
    return {"file": str(path), "wall_time_s": wall, "optimization_steps": st.optimizer.steps,
            "best_matchness": score if score is not None and score >= 0 else None, "optimization_done": st.optimizer.done,
            "tokens": st.tokens_seen}


def _roofline(eng, results, dev) -> dict:
    if AR not in next(iter(results.values()), {}).get("all", {}):
        return {}
    bw = copy_bandwidth(dev)
    wb = eng.model.weight_bytes()
    out = {"copy_bandwidth_gb_s": bw / 1e9, "weight_bytes": wb, "workloads": {}}
    for w, groups in results.items():
        tps = groups["all"].get(AR, {}).get("tokens_per_s")
        if tps:
            out["workloads"][w] = {"ar_tokens_per_s": tps, "ar_weight_gb_s": wb * tps / 1e9,
                                   "fraction_of_copy_bw": wb * tps / bw}
    return out


def write_outputs(out_dir: Path, tag: str, summary: dict, runs: list, plots: bool = True) -> list:
    model_id = summary["meta"]["model"]
    lines = []
    for r in runs:
        rec = {"question_id": r["prompt_id"], "category": r["category"], "model_id": model_id,
               "choices": [{"index": 0, "turns": [r.get("text") if "text" in r else None],
                            "decoding_steps": [r.get("decoding_steps")], "new_tokens": [r["new_tokens"]],
                            "wall_time": [r["wall_time_s"]], "accept_lengths": r.get("accept_lengths") or []}],
               "method": r["method"], "workload": r["workload"], "stream_index": r["stream_index"],
               "tokens_per_s": r["new_tokens"] / r["wall_time_s"] if r["wall_time_s"] else None,
               "M": (sum(r["accept_lengths"]) / len(r["accept_lengths"]))
               if r.get("accept_lengths") and not r["method"].startswith("hf-") else None,
               "alpha": (r["accepted"] / r["drafted"]) if r.get("drafted") else None,
               "token_ids": r["token_ids"], "diff_vs_hf": r.get("diff_vs_hf"), "diff_vs_ar": r.get("diff_vs_ar")}
        for k in ("skip_set", "time_optimize_s", "time_draft_s", "time_verify_s", "matchness_history",
                  "best_matchness", "optimization_done", "optimization_steps", "max_tree_nodes", "phases",
                  "finish_reason", "peak_gpu_mem_mb", "plain_steps", "accepted_by_source", "tree_sizes",
                  "longest_bo_stall_ms", "bo_errors", "expected_vs_measured"):
            if k in r:
                rec[k] = r[k]
        lines.append(json.dumps(rec))
    paths = [atomic_write(out_dir / f"{tag}.samples.jsonl", "\n".join(lines) + "\n"),
             atomic_write(out_dir / f"{tag}.summary.json", json.dumps(summary, indent=1) + "\n"),
             atomic_write(out_dir / f"{tag}.md", markdown_tables(summary))]
    if plots:
        from bench.plots import plot_all

        paths += plot_all(out_dir, tag, summary, runs)
    return paths


if __name__ == "__main__":
    raise SystemExit(main())
