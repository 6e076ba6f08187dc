"""MoA drafters' agreement with the target on the same held-out text, side by side.

    python -m bench.drafter_agreement --model smollm2-135m --drafter old=PATH --drafter new=PATH [--tokens 1000000]

The text is ``swiftk train-drafter``'s default corpus (stdlib, site-packages, docs; built or read from the cache
with the same ``--tokens``): its held-out documents (never trained on by a drafter made with that corpus) and, for
a view of fitting, its first training chunks. Per drafter: the rate at which its top-1 over the draft vocabulary is
the target's greedy token, by depth past the last verified token (train.evaluate). Writes
``bench/results/drafter_agreement_<model>_<date>.json``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.drafter_agreement", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", action="append", required=True, metavar="LABEL=PATH")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="corpus size (as train-drafter's --tokens)")
    ap.add_argument("--chunks", type=int, default=24, help="held-out chunks of 384 tokens")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    pairs = [d.partition("=") for d in a.drafter]
    if any(not sep or not lb or not Path(p).is_file() for lb, sep, p in pairs):
        raise SystemExit("--drafter wants LABEL=PATH of an existing file")

    import torch
    import swiftk
    from benchlib.machine import machine_info
    from swiftk.atomic import write_json_atomic
    from swiftk.moa import corpus as C, data as D, train as T
    from swiftk.moa.model import load
    from swiftk.proposers.draft_head import frequent_token_ids

    e = swiftk.load(a.model, persist=False)
    text = C.corpus(e.target, ["stdlib", "site-packages", "docs"], a.tokens, progress=False)
    ids = frequent_token_ids(e.tokenizer, 8192, model_name=str(e.identity.get("name") or "model"))
    drafters = {lb: load(path, e.config) for lb, _, path in pairs}
    max_tli = max(d.cfg.tli for d, _ in drafters.values())

    def feats(rows):
        return [{k: v[0] for k, v in D.batch_features(e.model, rows[i:i + 1], max_tli).items()}
                for i in range(len(rows))]

    held = feats(C.chunks(text["held_out"], 384)[: a.chunks])
    seen = feats(C.chunks(text["train"], 384)[:8])
    res = {}
    for lb, _, path in pairs:
        d, extra = drafters[lb]
        frozen = T.Frozen(e.model, d.cfg.tli, ids)
        res[lb] = {"path": path, "held_out": T.evaluate(d, frozen, held, ids, 4),
                   "training_chunks": T.evaluate(d, frozen, seen, ids, 1),
                   "trained": {k: extra.get(k) for k in ("train_tokens_seen", "train_tokens", "steps", "train_s",
                                                         "recipe")}}
        print(f"{lb}: held-out {res[lb]['held_out']['acceptance_by_depth']}, training chunks "
              f"{res[lb]['training_chunks']['acceptance_by_depth']}")
    model = Path(a.model).name.removesuffix(".gguf")
    path = Path(a.out) / f"drafter_agreement_{model}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json_atomic(path, {"args": vars(a), "machine": machine_info(e.device, torch.get_num_threads()),
                             "held_out_tokens": len(held) * 384, "results": res})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
