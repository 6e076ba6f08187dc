"""Replay: drafters compared on identical outputs, through generate's own round and a measured cost table.

The greedy output of every prompt is decoded once (swiftk autoregressive), and the target's top-k after each output
token is taken from one teacher-forced pass. Each drafter then replays every output through the round generate runs
(decoding.loop.Decoder in a batch of one: sources, tree, gate, source budget, acceptance, learning) against a recorded
target that scores every pass from those top-k lists, so the round accepts what agrees with the known output and
Token Recycling learns the real scores; a fixed verify budget instead of the gate is speculate="always" with
max_tree_nodes. Time per round = the round's measured drafting time + the cost table's verify pass,
so the replay predicts the speedup over autoregressive before a decode is run, and compares drafters on the same
tokens (ours vs ArcticInference's suffix cache at the same budget, bench/arctic.py).

    python -m bench.replay --model smollm2-135m --workloads humaneval,mtbench --n 8 --n-mtbench 2
    python -m bench.replay ... --budgets 8,16,32      # fixed verify budgets, no gate: accepted tokens per pass
    python -m bench.replay ... --costs 8.0,2:1.04,4:1.18,8:1.44,16:2.3   # one cost table for runs to compare
    python -m bench.replay ... --prefill-from bench/results/drafting_M_DATE.json   # + wall time, prefill included

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

from swiftk.decoding.gate import Gate
from swiftk.target.costs import CostModel
from swiftk.decoding.batch import Batch
from swiftk.decoding.loop import Decoder, verify
from swiftk.decoding.output import TokenSink
from swiftk.sample.sampler import Sampler, SamplingParams
from swiftk.decoding.session import Session
from swiftk.decoding.tree import build_tree
from swiftk.options import DecodeConfig, updated
from swiftk.proposers import free_sources
from swiftk.proposers.base import Chain, FreeSource

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


def parse_costs(text: str) -> dict:
    """``--costs``: "STEP_MS,T:STEPS,..." -> {1: step s, T: seconds}."""
    head, *rest = [x.strip() for x in text.split(",") if x.strip()]
    try:
        step = float(head) / 1e3
        table = {1: step, **{int(t): float(v) * step for t, v in (x.split(":") for x in rest)}}
    except ValueError as e:
        raise SystemExit(f"--costs: {text!r} is not STEP_MS,T:STEPS,... ({e})") from e
    if not (step > 0 and all(t > 1 and v >= step for t, v in table.items() if t != 1) and len(table) > 1):
        raise SystemExit(f"--costs: {text!r}: a positive step and verify passes T > 1 of at least one step")
    return table


def cost_model(eng, table: dict):
    """A cost model holding the table's figures (observed now, not loaded from a file: fully believed) that the
    replay's own pass times do not move."""
    cm = FixedCosts(eng.model)
    cm.observe_step(table[1])
    for T, dt in table.items():
        if T > 1:
            cm.observe_verify(T, dt)
    cm.fixed = True
    return cm


class FixedCosts(CostModel):
    fixed = False

    def observe_step(self, dt: float) -> None:
        if not self.fixed:
            super().observe_step(dt)

    def observe_verify(self, T: int, dt: float) -> None:
        if not self.fixed:
            super().observe_verify(T, dt)


class RecordedTarget:
    """The target model as the replay's round sees it: the row of a pass at position p scores the top-k the real
    target gave after reading position p of the recorded output (the output's next token first), so greedy
    acceptance follows that output and Token Recycling learns what it would have from the real scores."""

    def __init__(self, vocab_size: int):
        self.device, self.vocab, self.by_pos = torch.device("cpu"), vocab_size, {}
        self.ranks = torch.arange(TOPK, 0, -1, dtype=torch.float32)

    def load(self, row: dict) -> None:
        P, out = len(row["ids"]), row["out"]
        self.by_pos = {P - 1: [out[0]]}   # the prefill's pick
        for j, top in enumerate(row["topk"]):
            nxt = out[j + 1:j + 2]
            self.by_pos[P + j] = (nxt + [t for t in top if t not in nxt])[:TOPK]

    def forward(self, token_ids, positions, slots, cache, attn_mask=None, logits_idx=None, **_) -> torch.Tensor:
        pos = (positions if logits_idx is None else positions[logits_idx]).tolist()
        out = torch.zeros(len(pos), self.vocab)   # past the output: token 0's row, nothing follows it there
        for r, p in enumerate(pos):
            top = self.by_pos.get(p)
            if top:
                out[r, top] = self.ranks[:len(top)]
        return out


# ---------------------------------------------------------------- drafters
class Ours:
    """swiftk's free sources: made per request as generate makes them, one learned state across requests (carried
    estimates, gate memory, session history, the successor table)."""

    def __init__(self, eng, options: dict):
        self.eng, self.options = eng, options
        self.state = eng.new_state()

    def begin(self, prompt: list) -> None:
        pass

    def sources(self, cfg) -> list:
        out = free_sources(self.state, cfg, self.eng.config.vocab_size, self.eng.corpus)
        for src in out:
            if src.learns:
                src.learn = _recorded_rows_only(src.learn)
        return out

    def end(self, output: list) -> None:
        self.state.history.add(output)


def _recorded_rows_only(learn):
    """A learner's ``learn`` that skips the rows past the recorded output (a draft accepted beyond its end scores
    all zeros there: the real target was never asked), so Token Recycling stores only real top-k lists."""
    def wrapped(tokens, logits, rows):
        known = [i for i, r in enumerate(rows) if bool(logits[r].abs().amax() > 0)]
        if known:
            learn([tokens[i] for i in known], logits, [rows[i] for i in known])
    return wrapped


class External:
    """A drafter with begin/propose(tokens, budget) -> chains/end (bench/arctic.py) as the round's one free source,
    priced flat (0.99 a node), on a learned state of its own that only its gate memory uses."""

    def __init__(self, obj, budget: int):
        self.obj, self.budget, self.options = obj, budget, {}
        self.state = None

    def begin(self, prompt: list) -> None:
        self.obj.begin(list(prompt))

    def sources(self, cfg) -> list:
        return [_ExternalSource(self.obj, self.budget)]

    def end(self, output: list) -> None:
        self.obj.end(list(output))


class _ExternalSource(FreeSource):
    name = "draft_ext"

    def __init__(self, obj, budget: int):
        super().__init__()
        self.obj, self.budget = obj, budget

    def propose(self, ctx) -> list:
        return [Chain(list(c), [0.99] * len(c), self.name, [0] * len(c))
                for c in self.obj.propose(list(ctx.tokens), self.budget) if c]

    def observe(self, key: int, hit: bool) -> None:
        pass


# ---------------------------------------------------------------- the replay: generate's round on a recorded target
def _decode_alone(s: Session, sources: list):
    """The call's rounds until done, as generate drives a lone call (a batch of one); its DecodeStats."""
    d, batch = Decoder(s, None, sources), Batch(s.model, whole_prompts=True)
    batch.add(d)

    def failed(_, e):
        raise e

    while not d.done:
        batch.step(failed)
    return d.close()


def replay(eng, drafter, rows: list, costs, budget: int = 0) -> dict:
    """Replays ``rows`` through ``drafter`` with the round generate runs (decoding.loop.Decoder, driven by a Batch of one) against
    a :class:`RecordedTarget`; ``budget`` 0: the gate sizes each tree, else every tree keeps its ``budget``
    likeliest nodes (speculate="always"). Time per round: the round's measured drafting time (proposals and the
    tree) plus the cost table's verify pass. Returns totals and the predicted speed."""
    fixed = {"speculate": "always", "max_tree_nodes": budget} if budget else {}
    cfg = updated(DecodeConfig(), {**drafter.options, **fixed, "trace": True})
    state = drafter.state if drafter.state is not None else eng.new_state()
    target = RecordedTarget(eng.config.vocab_size)
    tot = {"tokens": 0, "passes": 0, "plain": 0, "accepted": 0, "time_s": 0.0, "host_s": 0.0, "nodes": 0}
    for row in rows:
        target.load(row)
        out = row["out"]
        drafter.begin(row["ids"])
        sources = drafter.sources(cfg)
        sink = TokenSink(eng.tokenizer, len(out))
        s = Session(target, eng.cache, costs, Gate(costs, state.gate, cfg), Sampler(SamplingParams(), "cpu"), sink,
                    cfg, list(row["ids"]), [x.name for x in sources])
        st = _decode_alone(s, sources)
        if sink.ids != out:
            raise RuntimeError(f"replay of {row['id']} left the recorded output at token "
                               f"{next(i for i, (a, b) in enumerate(zip(sink.ids + [-1], out)) if a != b)}")
        drafter.end(out)
        n = len(out) - 1   # out[0] comes from the prefill
        tot["tokens"] += n
        tot["passes"] += st.rounds
        tot["plain"] += st.plain_steps
        tot["accepted"] += min(st.accepted_tokens, n - st.rounds - st.plain_steps)   # cut at the output's end
        tot["nodes"] += sum(st.tree_sizes)
        tot["host_s"] += st.time_draft_s
        tot["time_s"] += st.time_draft_s + sum(costs.v(T) for T in st.tree_sizes) + st.plain_steps * costs.v(1)
    ar_time = tot["tokens"] * costs.step
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
    ap.add_argument("--costs", default="", help="a fixed cost table instead of measuring one: a plain step's "
                    "milliseconds, then T:steps for verify passes (e.g. 8.0,2:1.04,4:1.18,8:1.44,16:2.3); on a "
                    "noisy machine the measured table moves 20%% between runs, so A/B predictions share one")
    ap.add_argument("--prefill-from", default="", help="a bench.drafting run's .json on the same prompts: its "
                    "autoregressive prefill share per workload turns each prediction into wall time")
    ap.add_argument("--prefill-scale", type=float, default=1.0, help="with --prefill-from: prefills this many "
                    "times as long (a kernel that prefills 1.8x faster: 0.55)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--weights", default=None, help="swiftk's weight format (as bench.drafting's --weights)")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    import swiftk
    from benchlib.machine import machine_info
    from benchlib.prompts import build_prompts

    eng = swiftk.load(a.model, persist=False, weights=a.weights)
    eng.corpus(wait=True)
    from benchlib.workloads import data_dir

    prompts = build_prompts(eng, a.workloads.split(","), a.n, a.n_mtbench, a.max_new_tokens, a.skip,
                            a.skip_mtbench)
    cache_dir = data_dir().parent
    table = parse_costs(a.costs) if a.costs else cost_table(eng)
    costs = cost_model(eng, table)
    print("cost table (steps):", {k: round(v / table[1], 2) for k, v in table.items()})
    budgets = [0] + [int(b) for b in a.budgets.split(",") if b]
    if any(not 2 <= b <= 64 for b in budgets[1:]):
        ap.error("--budgets: each verify budget is a tree of 2..64 nodes (generate's max_tree_nodes)")
    share = prefill_share(a.prefill_from) if a.prefill_from else {}
    results = {}
    for w, items in prompts.items():
        rows = outputs(eng, items, a.max_new_tokens, cache_dir / "replay" / a.model)
        for name in a.configs.split(","):
            for b in budgets:
                r = replay(eng, Ours(eng, CONFIGS[name]), rows, costs, b)
                if w in share:
                    r["predicted_wall"] = with_prefill(r["predicted_speedup"], share[w], a.prefill_scale)
                results[(w, name, b)] = r
                print(f"{w:10s} {name:16s} budget={b or 'gate':>4} tokens/pass {r['tokens_per_pass']:.2f} "
                      f"plain {r['plain']:4d} tree {r['mean_tree']:.1f} predicted {r['predicted_speedup']:.2f}x"
                      + (f" wall {r['predicted_wall']:.2f}x" if w in share else ""))
        if a.arctic:
            from bench.arctic import ArcticSuffix

            for b in budgets[1:] or [16]:
                r = replay(eng, External(ArcticSuffix(), b), rows, costs, b)
                results[(w, "arctic-suffix", b)] = r
                print(f"{w:10s} {'arctic-suffix':16s} budget={b:>4} tokens/pass {r['tokens_per_pass']:.2f} "
                      f"predicted {r['predicted_speedup']:.2f}x")
    _write(a, eng, table, results, machine_info(eng.device, torch.get_num_threads()))
    return 0


def prefill_share(path: str) -> dict:
    """Per workload, the share of swiftk autoregressive's wall time that its prefills took in a bench.drafting run."""
    try:
        runs = json.loads(Path(path).read_text())["runs"]
        pre, wall = {}, {}
        for r in runs:
            w, ar = r["workload"], r["swiftk-ar"]
            pre[w], wall[w] = pre.get(w, 0.0) + ar["prefill_s"], wall.get(w, 0.0) + ar["wall_s"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--prefill-from: {path!r} is not a bench.drafting run's .json ({e})") from e
    return {w: pre[w] / wall[w] for w in wall if wall[w] > 0}


def with_prefill(decode_speedup: float, share: float, scale: float = 1.0) -> float:
    """A decode-only speedup as wall time when prefill took ``share`` of autoregressive's wall time (``scale``: the
    prefill made that many times as long, on both sides)."""
    p = share * scale
    return (p + 1.0 - share) / (p + (1.0 - share) / decode_speedup)


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
             "| workload | drafter | budget | tokens/pass | plain steps | mean tree | predicted speedup | "
             "with the prefill |",
             "|---|---|---|---|---|---|---|---|"]
    for (w, name, b), r in results.items():
        wall = f"{r['predicted_wall']:.2f}x" if "predicted_wall" in r else "-"
        lines.append(f"| {w} | {name} | {b or 'gate'} | {r['tokens_per_pass']:.2f} | {r['plain']} | "
                     f"{r['mean_tree']:.1f} | {r['predicted_speedup']:.2f}x | {wall} |")
    (out / f"replay_{a.model}_{stamp}.md").write_text("\n".join(lines) + "\n")
    (out / f"replay_{a.model}_{stamp}.json").write_text(json.dumps(
        {"args": vars(a), "machine": machine, "cost_table_s": table,
         "results": [{"workload": w, "drafter": n, "budget": b, **r} for (w, n, b), r in results.items()]}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
