"""Write the MoA drafter's training prompts (the evaluation prompts kept out).

    python -m bench.moa_prompts OUT.jsonl

The benchmarks evaluate on the first n HumanEval problems (n <= 82) and the first n MT-Bench questions of each
category (n <= 5), turn 1. Training takes the rest: HumanEval/82..163 (raw completion) and MT-Bench questions 6..10
of every category (turn 1, chat). `swiftk train-drafter --data OUT.jsonl` answers each with the model itself.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchlib import workloads as W
from swiftk.atomic import write_atomic

EVAL_HUMANEVAL = 82
EVAL_MTBENCH_PER_CATEGORY = 5


def training_prompts() -> list:
    rows = [{"text": p["turns"][0], "chat": False, "id": p["id"]} for p in W.humaneval()[EVAL_HUMANEVAL:]]
    seen: dict = {}
    for q in W.mtbench():
        c = q["category"]
        seen[c] = seen.get(c, 0) + 1
        if seen[c] > EVAL_MTBENCH_PER_CATEGORY:
            rows.append({"text": q["turns"][0], "chat": True, "id": q["id"]})
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    rows = training_prompts()
    write_atomic(Path(argv[0]), "".join(json.dumps(r) + "\n" for r in rows))
    print(f"{argv[0]}: {len(rows)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
