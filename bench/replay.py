"""Replay: drafters compared on identical outputs, with swiftk's real tree builder and gate and a measured cost table.

The greedy output of every prompt is decoded once (swiftk autoregressive), and the target's top-k after each output
token is taken from one teacher-forced pass. Each drafter then replays every output: per round it proposes from the
sequence so far, the tree is built and gated exactly as in ``generate`` (or cut to a fixed verify budget), the
accepted path is the longest one that agrees with the known output, and the drafter learns from the outcome (Token
Recycling from the recorded top-k). Time per round = the drafter's measured host time + the cost table's verify pass,
so the replay predicts the speedup over autoregressive before a decode is run, and compares drafters on the same
tokens (ours vs ArcticInference's suffix cache at the same budget, bench/arctic.py).

    python -m bench.replay --model smollm2-135m --workloads humaneval,mtbench --n 8 --n-mtbench 2
    python -m bench.replay ... --budgets 8,16,32      # fixed verify budgets, no gate: accepted tokens per pass

Writes bench/results/replay_<model>_<date>.md (and .json).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

TOPK = 8

# drafter name -> the free sources it switches on (everything else off); "default" = generate's default set
CONFIGS = {
    "default": {},
    "context": {"history": False, "recycle": False, "datastore": False},
    "context+history": {"recycle": False, "datastore": False},
    "recycle": {"ngram": False, "history": False, "datastore": False},
    "no-recycle": {"recycle": False},
}


# ---------------------------------------------------------------- data: outputs and the target's top-k
def outputs(eng, items: list, max_new: int, cache_dir: Path) -> list:
    """Per item: {"ids", "out", "topk"} -- the greedy output (swiftk autoregressive) and the target's top-k after
    each output token (teacher-forced), cached on disk by model, prompt and length."""
    rows = []
    for it in items:
        info = eng.info()
        key = hashlib.sha256(json.dumps([info.get("model", ""), it["ids"], max_new]
                                        + ([info["weights"]] if info.get("weights") else [])).encode()).hexdigest()[:20]
        f = cache_dir / f"{key}.json"
        if f.is_file():
            rows.append(json.loads(f.read_text()))
            continue
        out = eng.generate(it["ids"], max_new_tokens=max_new, method="autoregressive").token_ids
        seq, P = list(it["ids"]) + out, len(it["ids"])
        model, cache = eng.model, eng.cache
        cache.reset()
        ar = torch.arange(len(seq))
        with torch.no_grad():
            logits = model.forward(torch.tensor(seq), ar, ar, cache, logits_idx=torch.arange(P, len(seq)))
        cache.reset()
        row = {"id": it["id"], "category": it["category"], "ids": list(it["ids"]), "out": out,
               "topk": logits.topk(TOPK, dim=-1).indices.tolist()}
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(row))
        tmp.replace(f)
        rows.append(row)
    return rows


def cost_table(eng, sizes=(1, 2, 4, 8, 12, 16, 24, 32), context: int = 256, repeats: int = 7) -> dict:
    """Seconds of a verify pass over T tokens (a chain) after ``context`` committed tokens, median of ``repeats``."""
    from swiftk.decoding.loop import verify
    from swiftk.decoding.tree import Chain, build_tree

    model, cache = eng.model, eng.cache
    ids = list(range(100, 100 + context))
    cache.reset()
    ar = torch.arange(context)
    with torch.no_grad():
        model.forward(torch.tensor(ids), ar, ar, cache, logits_idx=torch.tensor([context - 1]))
    cache.advance(context)
    chains = {T: [Chain(list(range(200, 200 + T - 1)), [0.9] * (T - 1), "x")] if T > 1 else [] for T in sizes}
    trees = {T: build_tree(5, [], context, 64, "cpu", chains=c) for T, c in chains.items()}
    times: dict = {T: [] for T in sizes}
    for _ in range(repeats):   # sizes interleaved: a slow spell of the machine falls on all of them, not on one
        for T in sizes:
            t = time.perf_counter()
            with torch.no_grad():
                verify(model, cache, trees[T], [], None) if T > 1 else model.forward(
                    torch.tensor([5]), torch.tensor([context]), torch.tensor([context]), cache, start=context)
            times[T].append(time.perf_counter() - t)
    out = {T: statistics.median(v) for T, v in times.items()}
    cache.reset()
    return out


def cost_model(eng, table: dict):
    from swiftk.decoding.costs import CostModel

    cm = CostModel(eng.model)   # observed now (not loaded from a file): fully believed
    cm.observe_step(table[1])
    for T, dt in table.items():
        if T > 1:
            cm.observe_verify(T, dt)
    return cm


# ---------------------------------------------------------------- drafters
class Ours:
    """swiftk's free sources as one drafter: fresh sources per request (like a call), one learned state across
    requests (carried estimates, session history, the successor table)."""

    def __init__(self, eng, options: dict):
        from swiftk.runtime.config import DecodeConfig, updated

        self.eng, self.cfg = eng, updated(DecodeConfig(), options)
        self.state = eng.new_state()
        self.sources, self.owners = [], {}

    def begin(self, prompt: list) -> None:
        from swiftk.proposers import free_sources

        self.sources = free_sources(self.eng, self.state, self.cfg)
        self.owners = {s.name: s for s in self.sources}

    def propose(self, ctx) -> list:
        from swiftk.decoding.loop import as_chains

        return [c for src in self.sources for c in as_chains(src.propose(ctx))]

    def learn(self, tree, path: list, read: list, topk: list) -> None:
        if tree is not None:
            for i, hit in tree.outcomes(path):
                self.owners[tree.source[i]].observe(tree.key[i], hit)
        for src in self.sources:
            if src.learns:
                src.succ.put(torch.tensor(read), torch.tensor(topk, dtype=torch.int32))

    def end(self, output: list) -> None:
        self.state.history.add(output)


class External:
    """A drafter with begin/propose(tokens, budget) -> chains/end (bench/arctic.py), priced flat for the tree."""

    def __init__(self, obj, budget: int):
        self.obj, self.budget = obj, budget

    def begin(self, prompt: list) -> None:
        self.obj.begin(list(prompt))

    def propose(self, ctx) -> list:
        from swiftk.decoding.tree import Chain

        return [Chain(list(c), [0.99] * len(c), "draft_ext") for c in self.obj.propose(list(ctx.tokens), self.budget)
                if c]

    def learn(self, tree, path, read, topk) -> None:
        pass

    def end(self, output: list) -> None:
        self.obj.end(list(output))


# ---------------------------------------------------------------- the replay loop
def replay(drafter, rows: list, costs, budget: int = 0) -> dict:
    """Replays ``rows`` through ``drafter``; ``budget`` 0: the gate sizes each tree (as generate does), else every
    tree keeps its ``budget`` likeliest nodes. Returns totals and predicted speed."""
    from swiftk.runtime.config import DecodeConfig
    from swiftk.decoding.costs import Gate
    from swiftk.proposers.base import Context
    from swiftk.decoding.state import GateMemory
    from swiftk.decoding.tree import build_tree

    cfg = DecodeConfig()
    step = costs.step
    tot = {"tokens": 0, "passes": 0, "plain": 0, "accepted": 0, "time_s": 0.0, "host_s": 0.0, "nodes": 0}
    for row in rows:
        gate = Gate(costs, GateMemory(), cfg)
        max_nodes = budget or 64
        prompt, out, topk = row["ids"], row["out"], row["topk"]
        drafter.begin(prompt)
        tokens, i = list(prompt) + out[:1], 1   # out[0] comes from the prefill; it is the first root
        while i < len(out):
            t = time.perf_counter()
            ctx = Context(tokens, min(cfg.max_draft, max_nodes - 1), gate.value_floor if not budget else 0.0)
            chains = drafter.propose(ctx)
            t_draft = time.perf_counter() - t
            tree = None
            if chains:
                size = (lambda vals: min(len(vals), budget - 1)) if budget else (lambda vals: gate.free_size(t_draft, vals))
                tree = build_tree(tokens[-1], [], len(tokens) - 1, max_nodes, "cpu", chains=chains, choose_size=size)
            host = time.perf_counter() - t
            tot["host_s"] += host
            if tree is None or tree.size == 1:
                tot["plain"] += 1
                tot["time_s"] += host + costs.v(1)
                drafter.learn(None, [0], [tokens[-1]], [topk[i - 1]])
                tokens.append(out[i])
                i += 1
                continue
            path, node = [0], 0   # greedy acceptance: follow the known output down the tree
            par, tok = tree.parents.tolist(), tree.tokens.tolist()
            while True:
                nxt = next((c for c in range(1, tree.size) if par[c] == node and i + len(path) - 1 < len(out)
                            and tok[c] == out[i + len(path) - 1]), None)
                if nxt is None:
                    break
                path.append(nxt)
                node = nxt
            if gate.probing:
                gate.probed(len(path) > 1)
            n_new = min(len(path), len(out) - i)   # accepted + bonus, cut at the output's end
            read = [tok[j] for j in path]
            drafter.learn(tree, path, read, [topk[i - 1 + d] for d in range(len(path))])
            tokens += out[i:i + n_new]
            i += n_new
            tot["passes"] += 1
            tot["accepted"] += len(path) - 1
            tot["nodes"] += tree.size
            tot["time_s"] += host + costs.v(tree.size)
        drafter.end(out)
        tot["tokens"] += len(out) - 1
    ar_time = tot["tokens"] * step
    tot["tokens_per_pass"] = (tot["accepted"] + tot["passes"]) / tot["passes"] if tot["passes"] else 1.0
    tot["predicted_speedup"] = ar_time / tot["time_s"] if tot["time_s"] else 1.0
    tot["mean_tree"] = tot["nodes"] / tot["passes"] if tot["passes"] else 0.0
    return tot


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default="humaneval,mtbench")
    ap.add_argument("--n", type=int, default=8, help="HumanEval, edit and chat prompts")
    ap.add_argument("--n-mtbench", type=int, default=2, help="MT-Bench questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--skip", type=int, default=0, help="pass over the first HumanEval/edit/chat prompts (held out)")
    ap.add_argument("--skip-mtbench", type=int, default=0, help="pass over the first MT-Bench questions per category")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--budgets", default="", help="fixed verify budgets to compare at (e.g. 8,16,32); the gate "
                    "always runs too")
    ap.add_argument("--arctic", action="store_true", help="add ArcticInference's suffix cache (bench/arctic.py)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--weights", default=None, help="swiftk's weight format (as bench.drafting's --weights)")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    import swiftk
    from bench.e2e import build_prompts, machine_info

    eng = swiftk.load(a.model, persist=False, weights=a.weights)
    eng.corpus(wait=True)
    from bench.workloads import data_dir

    prompts = build_prompts(eng, a.workloads.split(","), a.n, a.n_mtbench, a.max_new_tokens, a.skip,
                            a.skip_mtbench)
    cache_dir = data_dir().parent
    table = cost_table(eng)
    costs = cost_model(eng, table)
    print("cost table (steps):", {k: round(v / table[1], 2) for k, v in table.items()})
    budgets = [0] + [int(b) for b in a.budgets.split(",") if b]
    results = {}
    for w, items in prompts.items():
        rows = outputs(eng, items, a.max_new_tokens, cache_dir / "replay" / a.model)
        for name in a.configs.split(","):
            for b in budgets:
                r = replay(Ours(eng, CONFIGS[name]), rows, costs, b)
                results[(w, name, b)] = r
                print(f"{w:10s} {name:16s} budget={b or 'gate':>4} tokens/pass {r['tokens_per_pass']:.2f} "
                      f"plain {r['plain']:4d} tree {r['mean_tree']:.1f} predicted {r['predicted_speedup']:.2f}x")
        if a.arctic:
            from bench.arctic import ArcticSuffix

            for b in budgets[1:] or [16]:
                r = replay(External(ArcticSuffix(), b), rows, costs, b)
                results[(w, "arctic-suffix", b)] = r
                print(f"{w:10s} {'arctic-suffix':16s} budget={b:>4} tokens/pass {r['tokens_per_pass']:.2f} "
                      f"predicted {r['predicted_speedup']:.2f}x")
    _write(a, eng, table, results, machine_info(eng.device, torch.get_num_threads()))
    return 0


def _write(a, eng, table, results, machine) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Replay: {a.model}, {a.workloads}, n={a.n}, n_mtbench={a.n_mtbench}, "
             f"max_new_tokens={a.max_new_tokens}", "",
             f"`python -m bench.replay {' '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in vars(a).items() if v not in (False, '', 0))}`",
             "", f"Machine: {machine}", "",
             "Cost table (verify pass of T tokens in decode steps): "
             + ", ".join(f"{k}: {v / table[1]:.2f}" for k, v in table.items()), "",
             "| workload | drafter | budget | tokens/pass | plain steps | mean tree | predicted speedup |",
             "|---|---|---|---|---|---|---|"]
    for (w, name, b), r in results.items():
        lines.append(f"| {w} | {name} | {b or 'gate'} | {r['tokens_per_pass']:.2f} | {r['plain']} | "
                     f"{r['mean_tree']:.1f} | {r['predicted_speedup']:.2f}x |")
    (out / f"replay_{a.model}_{stamp}.md").write_text("\n".join(lines) + "\n")
    (out / f"replay_{a.model}_{stamp}.json").write_text(json.dumps(
        {"args": vars(a), "machine": machine, "cost_table_s": table,
         "results": [{"workload": w, "drafter": n, "budget": b, **r} for (w, n, b), r in results.items()]}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
