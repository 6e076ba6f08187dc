"""A hostile-new-user sweep of swiftk: damaged model files, odd side files, a damaged $SWIFTK_HOME, bad API inputs,
bad CLI use and a hostile HTTP client. Every case runs in a subprocess with its own fresh SWIFTK_HOME (a copy of a
warmed template: a first-use kernel library in $H/kernels (the cases that damage it load it with
SWIFTK_CPU_KERNELS=build; the others load the installed one), corpus tables and draft vocabulary; the registry model is symlinked with its
``.verified`` marker, so nothing is downloaded and the real cache is never written) and is classified as one of

    clear error | correct | crash | hang | silently wrong | raw traceback | leftover

    .venv/bin/python tools/hostile_sweep.py [--only GROUP,...] [--jobs 2] [--out /tmp/hostile_sweep]

Prints a markdown table (counts per class and group) and the cases outside {clear error, correct}; writes the
full list to OUT.json and OUT.md. Reference for "correct": greedy ``method="autoregressive"`` output.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
CLASSES = ["clear error", "correct", "crash", "hang", "silently wrong", "raw traceback", "leftover"]
OK = {"clear error", "correct"}
# the checkout's own venv, else the swiftk on PATH (a clone swept with PYTHONPATH pointing at it)
SWIFTK_BIN = str(REPO / ".venv/bin/swiftk") if (REPO / ".venv/bin/swiftk").exists() else (shutil.which("swiftk") or "swiftk")
PROMPT = "def fib(n):"
NTOK = 16
TIMEOUT = 120

# ------------------------------------------------------------------------------------------------ child prelude
# Runs a list of cases in one interpreter, appending {"start": name} / {"name", "cls", "detail"} JSON lines to a
# log, so the parent can tell which case was running when the child died or hung.
CHILD = r'''
import gc, json, math, os, sys, threading, time, traceback
sys.path.insert(0, os.environ["SWEEP_REPO"])
LOG = open(sys.argv[1], "a", buffering=1)
CASES = json.loads(open(sys.argv[2]).read())
import torch
torch.set_num_threads(1)
import swiftk
from swiftk.errors import SwiftkError
M = os.environ["SWEEP_MODEL"]
PROMPT, NTOK = os.environ["SWEEP_PROMPT"], int(os.environ["SWEEP_NTOK"])
_ENG = {}
_AR = {}

class UserBoom(Exception):
    pass

def E():
    """The shared SmolLM2 engine of this child (persist off: cases cannot leak state through it)."""
    if "e" not in _ENG:
        _ENG["e"] = swiftk.load(M, persist=False)
        _ENG["ref"] = _ENG["e"].generate(PROMPT, max_new_tokens=NTOK, method="autoregressive").token_ids
    return _ENG["e"]

def REF():
    E()
    return _ENG["ref"]

def same(a, b, what="output"):
    if a == b:
        return ("correct", f"{what} equals autoregressive ({len(a)} tokens)")
    return ("silently wrong", f"{what} differs from autoregressive: {a[:12]} vs {b[:12]}")

def vs_ar(eng, prompt=PROMPT, n=NTOK, **kw):
    """generate(**kw) against method='autoregressive' with the same sampling options."""
    n = kw.pop("max_new_tokens", n)
    if kw.get("temperature") and "seed" not in kw:   # unseeded sampling is not reproducible: compare seeded
        kw["seed"] = 0
    samp = {k: kw[k] for k in ("temperature", "top_k", "top_p", "seed", "stop", "chat") if k in kw}
    out = eng.generate(prompt, max_new_tokens=n, **kw)
    key = repr((prompt, n, sorted(samp.items())))
    ref = _AR.get(key) if eng is _ENG.get("e") else None
    if ref is None:
        ref = eng.generate(prompt, max_new_tokens=n, method="autoregressive", **samp)
        if eng is _ENG.get("e"):
            _AR[key] = ref
    if out.token_ids and not all(isinstance(t, int) for t in out.token_ids):
        return ("silently wrong", f"non-int token ids {out.token_ids[:5]}")
    if n > 0 and not out.token_ids and out.finish_reason not in ("stop",):
        return ("silently wrong", f"empty output, finish_reason={out.finish_reason}")
    return same(out.token_ids, ref.token_ids)

def load_check(path, **kw):
    """Load any model; the load must fail with SwiftkError or give finite logits and swift == autoregressive."""
    eng = swiftk.load(str(path), **kw)
    ids = eng.encode_prompt("the the") if eng.config.vocab_size < 1000 else eng.encode_prompt(PROMPT)
    lg = eng.logits(ids)
    if not torch.isfinite(lg).all():
        return ("silently wrong", f"loaded; logits hold NaN/Inf ({int((~torch.isfinite(lg)).sum())} entries)")
    out = eng.generate(ids, max_new_tokens=8)
    ref = eng.generate(ids, max_new_tokens=8, method="autoregressive")
    if not out.token_ids and out.finish_reason != "stop":
        return ("silently wrong", "loaded; empty output")
    return same(out.token_ids, ref.token_ids, "loaded; swift")

def health():
    """After a case on the shared engine: a normal call must still give the reference."""
    if "e" not in _ENG:
        return None
    try:
        got = _ENG["e"].generate(PROMPT, max_new_tokens=NTOK).token_ids
    except Exception as e:
        return f"engine unusable after the case: {type(e).__name__}: {e}"
    return None if got == _ENG["ref"] else f"engine gives other output after the case: {got[:8]}"

for name, code in CASES:
    LOG.write(json.dumps({"start": name}) + "\n")
    t0 = time.time()
    try:
        ns = dict(globals())
        exec(code, ns)
        res = ns.get("res") or ("correct", "returned")
    except SwiftkError as e:
        res = ("clear error", f"SwiftkError: {e}")
    except UserBoom as e:
        res = ("clear error", f"the user's own exception propagated: UserBoom({e})")
    except BaseException as e:
        tb = traceback.extract_tb(e.__traceback__)
        where = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else "?"
        res = ("raw traceback", f"{type(e).__name__}: {str(e)[:300]} (at {where})")
    if res[0] in ("correct", "clear error") and "E()" in code:
        h = health()
        if h:
            res = ("silently wrong", f"{res[1]}; {h}")
    LOG.write(json.dumps({"name": name, "cls": res[0], "detail": str(res[1])[:500], "s": round(time.time() - t0, 2)}) + "\n")
'''

LEFTOVER_PATTERNS = (".partial-", ".wheels-", ".tmp", ".cpu_linear-", ".cpu_quant-", ".swiftk_cpu-", ".partial")
BUILD = {"SWIFTK_CPU_KERNELS": "build"}   # load the kernel library from $H/kernels (a first-use build), not the install


# ------------------------------------------------------------------------------------------------ homes
class Homes:
    def __init__(self, root: Path, model: Path):
        self.root, self.model, self.n = root, model, 0
        self.template = root / "template"

    def make_template(self):
        """A home with a first-use kernel library, corpus tables and draft vocabulary built (copied from the real
        caches where present, then warmed by one load + generate so nothing is built per case)."""
        real = Path(os.path.expanduser("~/.cache/swiftk"))
        t = self.template
        t.mkdir(parents=True)
        for sub in ("datastore", "draft_vocab"):
            if (real / sub).is_dir():
                shutil.copytree(real / sub, t / sub, ignore=shutil.ignore_patterns(".*", "*.tmp"))
        kernels = Path(os.environ.get("SWIFTK_KERNEL_CACHE") or os.path.expanduser("~/.cache/swiftk-kernels"))
        if kernels.is_dir():
            shutil.copytree(kernels, t / "kernels", ignore=shutil.ignore_patterns(".*", "*.tmp"))
        (t / "models").mkdir()
        os.symlink(self.model, t / "models" / self.model.name)
        marker = self.model.with_name(self.model.name + ".verified")
        if marker.exists():
            shutil.copy(marker, t / "models" / marker.name)
        code = (f"import torch; torch.set_num_threads(1); import swiftk; e = swiftk.load('smollm2-135m'); "
                f"e.generate({PROMPT!r}, max_new_tokens=32); e.generate({PROMPT!r}, max_new_tokens=8, method='ngram'); "
                f"print(e.states.path)")
        r = subprocess.run([PY, "-c", code], env=env_for(t, **BUILD), capture_output=True, text=True, timeout=900,
                           cwd=REPO)
        if r.returncode:
            sys.exit("template home failed:\n" + r.stderr[-3000:])
        sp = Path(r.stdout.strip().splitlines()[-1])
        self.state_rel = sp.relative_to(t)
        self.state_text = sp.read_text()
        shutil.rmtree(t / "state", ignore_errors=True)

    def new(self) -> Path:
        self.n += 1
        h = self.root / f"home{self.n:04d}"
        shutil.copytree(self.template, h, symlinks=True)
        return h


def env_for(home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWIFTK_")}
    env.update(SWIFTK_HOME=str(home), SWIFTK_KERNEL_CACHE=str(home / "kernels"), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               SWEEP_REPO=str(REPO), SWEEP_PROMPT=PROMPT, SWEEP_NTOK=str(NTOK))
    env.update(extra)
    return env


def leftovers(home: Path, before: set) -> list:
    bad = []
    for dirpath, dirnames, filenames in os.walk(home):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            if p in before:
                continue
            # a library is kept; a dot-named one is a writer's temp file
            if any(s in n for s in LEFTOVER_PATTERNS) and (not n.endswith(".so") or n.startswith(".")):
                bad.append(os.path.relpath(p, home))
    return bad


def snapshot(home: Path) -> set:
    out = set()
    for dirpath, dirnames, filenames in os.walk(home):
        out.update(os.path.join(dirpath, n) for n in dirnames + filenames)
    return out


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def procs_mentioning(home: Path, grace: float = 1.0) -> list:
    """Processes whose command line names this case's home (e.g. a compiler writing into its kernel cache) that are
    still running ``grace`` seconds on: children that left the case's process group count too."""
    deadline = time.monotonic() + grace
    while True:
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if str(home) in cmd and state != "Z":
                found.append(int(pid))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def kill_group(pgid: int):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------------ runners
class Case:
    def __init__(self, group, name, repro, kind="py", code="", argv=None, setup=None, shared=False, check=None,
                 timeout=TIMEOUT, stdin=None, twice=False, env=None, signal_after=None, signal_once=False):
        self.group, self.name, self.repro, self.kind = group, name, repro, kind
        self.code, self.argv, self.setup, self.shared, self.check = code, argv, setup, shared, check
        self.timeout, self.stdin, self.twice, self.env, self.signal_after = timeout, stdin, twice, env or {}, signal_after
        self.signal_once = signal_once   # twice: signal the first run only (the second must recover)
        self.cls, self.detail, self.seconds = None, "", 0.0


def run_py_batch(cases, homes: Homes, model: Path, workdir: Path):
    """Run python cases in one child (shared engine) or one child each; restart after a death or a hang."""
    todo = list(cases)
    while todo:
        home = homes.new()
        for c in todo:
            if c.setup:
                c.setup(home)
        before = snapshot(home)
        log = workdir / f"log-{homes.n}.jsonl"
        spec = workdir / f"cases-{homes.n}.json"
        spec.write_text(json.dumps([[c.name, c.code] for c in todo]))
        env = env_for(home, SWEEP_MODEL=str(model), **todo[0].env)
        p = subprocess.Popen([PY, "-c", CHILD, str(log), str(spec)], env=env, cwd=str(home), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
        err_chunks = []
        threading.Thread(target=lambda: err_chunks.append(p.stderr.read()), daemon=True).start()
        threading.Thread(target=lambda: p.stdout.read(), daemon=True).start()
        by_name = {c.name: c for c in todo}
        done, current, started = set(), None, time.monotonic()
        hung = False
        while True:
            rc = p.poll()
            txt = log.read_text() if log.exists() else ""
            lines = txt.split("\n")[:-1]   # complete lines only: the child may be writing the last one
            for ln in lines:
                try:
                    d = json.loads(ln)
                except ValueError:
                    continue
                if "start" in d:
                    if d["start"] != current and d["start"] not in done:
                        current, started = d["start"], time.monotonic()
                elif d["name"] not in done:
                    c = by_name[d["name"]]
                    c.cls, c.detail, c.seconds = d["cls"], d["detail"], d["s"]
                    done.add(d["name"])
                    if current == d["name"]:
                        current, started = None, time.monotonic()
            if rc is not None:
                break
            limit = by_name[current].timeout if current else 240   # 240: import + shared engine load
            if time.monotonic() - started > limit:
                kill_group(p.pid)
                p.wait()
                hung = True
                break
            time.sleep(0.1)
        if group_alive(p.pid):
            kill_group(p.pid)
        time.sleep(0.2)
        err = (err_chunks[0] if err_chunks else b"").decode(errors="replace")
        rest = [c for c in todo if c.name not in done]
        if rest:
            victim = by_name[current] if current and current not in done else rest[0]
            if hung:
                victim.cls, victim.detail = "hang", f"no result after {victim.timeout} s"
            elif p.returncode < 0:
                victim.cls = "crash"
                victim.detail = f"killed by {signal.Signals(-p.returncode).name}: {err.strip()[-200:]}"
            else:
                victim.cls = "raw traceback"
                victim.detail = f"child exited {p.returncode}: {err.strip()[-300:]}"
            victim.seconds = round(time.monotonic() - started, 1)
            rest = [c for c in rest if c is not victim]
        left = leftovers(home, before)
        if left and len(todo) == 1 and todo[0].cls in OK:
            todo[0].cls, todo[0].detail = "leftover", f"{todo[0].detail}; left in SWIFTK_HOME: {left[:4]}"
        elif left:
            print(f"  (leftovers after a shared batch: {left[:4]})", file=sys.stderr)
        shutil.rmtree(home, ignore_errors=True)
        todo = rest


def cli_class(rc, out, err, expect_ok_check=None):
    if rc is None:
        return "hang", "timed out"
    if "Traceback (most recent call last)" in err:
        last = [l for l in err.strip().splitlines() if l.strip()][-1] if err.strip() else ""
        return "raw traceback", f"exit {rc}, traceback ending: {last[:250]}"
    if rc < 0:
        return "crash", f"killed by {signal.Signals(-rc).name}"
    if rc == 0:
        if expect_ok_check:
            return expect_ok_check(out, err)
        return "correct", "exit 0"
    lines = [l for l in err.strip().splitlines() if l.strip()]
    if rc == 2 and lines and (lines[-1].startswith("swiftk: error: ") or ": error: " in lines[-1]):
        return "clear error", lines[-1][:300]
    return "raw traceback", f"exit {rc} without a 'swiftk: error:' line: {err.strip()[-250:]!r}"


def run_cli(c: Case, homes: Homes, workdir: Path):
    runs = 2 if c.twice else 1
    home = homes.new()
    if c.setup:
        c.setup(home)
    before = snapshot(home)
    results = []
    for i in range(runs):
        argv = [SWIFTK_BIN,
                *[a.replace("{HOME}", str(home)) for a in c.argv]]
        t0 = time.monotonic()
        p = subprocess.Popen(argv, env=env_for(home, **c.env), cwd=str(home), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdin=subprocess.PIPE if c.stdin is not None else subprocess.DEVNULL,
                             start_new_session=True)
        fired = []
        signalled = c.signal_after is not None and not (c.signal_once and i > 0)
        if signalled:
            sig, after = c.signal_after
            def fire():
                time.sleep(after)
                if p.poll() is None:
                    p.send_signal(sig)
                    fired.append(sig)
            threading.Thread(target=fire, daemon=True).start()
        try:
            out, err = p.communicate(c.stdin.encode("utf-8", "surrogateescape") if c.stdin is not None else None,
                                    timeout=c.timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            kill_group(p.pid)
            out, err = p.communicate()
            rc = None
        c.seconds = round(time.monotonic() - t0, 1)
        out, err = out.decode(errors="replace"), err.decode(errors="replace")
        stray = group_alive(p.pid)
        if stray:
            kill_group(p.pid)
        others = procs_mentioning(home)
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        stray = stray or bool(others)
        cls, detail = cli_class(rc, out, err, c.check)
        if signalled and not fired and rc is not None:
            detail = f"{detail} (it ended before the signal was sent: the case needs a longer run)"
        if signalled and "Traceback" not in err:
            sig = c.signal_after[0]
            if rc == 130 and sig == signal.SIGINT:
                cls, detail = "correct", "exit 130 after SIGINT"
            elif rc == -signal.SIGTERM and sig == signal.SIGTERM:
                cls, detail = "correct", "died by SIGTERM, no traceback"
            elif rc == -signal.SIGKILL and sig == signal.SIGKILL:
                cls, detail = "correct", "killed"
            elif rc == 0 and fired and sig == signal.SIGINT:
                cls, detail = "silently wrong", "SIGINT was lost: the run went on and exited 0"
            elif rc is not None and rc < 0:
                detail = f"{detail} (expected exit 130 / death by SIGTERM); stderr: {err.strip()[-150:]!r}"
        if rc is None and c.argv and c.argv[0] == "serve":
            if c.name == "serve:queue-0":   # documented: only the running request, none waiting
                cls, detail = "correct", "serving with no waiting room"
            else:
                cls, detail = "silently wrong", f"accepted the value and started serving (still up after {c.timeout} s)"
        if stray and cls in OK:
            cls, detail = "leftover", f"{detail}; child processes still running after exit"
        results.append((cls, detail))
    if runs == 2:
        (c1, d1), (c2, d2) = results
        if c2 not in OK:
            c.cls, c.detail = c2, f"second run: {d2} (first run: {c1}: {d1[:120]})"
        else:
            c.cls, c.detail = (c1, d1) if c1 not in OK else (c2, f"first: {c1}: {d1[:150]}; second: {d2[:150]}")
    else:
        c.cls, c.detail = results[0]
    left = leftovers(home, before)
    if left and c.cls in OK:
        c.cls, c.detail = "leftover", f"{c.detail}; left in SWIFTK_HOME: {left[:4]}"
    shutil.rmtree(home, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ fixtures
def make_fixtures(fx: Path):
    """Tiny synthetic models (4 layers) and their damaged variants; returns {name: path}."""
    sys.path.insert(0, str(REPO / "tests"))
    import test_loaders as tl

    tl.L = 4
    import test_bad_inputs as tb

    tb.L = 4
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import save_file

    out = {}
    good = fx / "good.gguf"
    tl.write_tiny_gguf(good, "llama")
    out["good.gguf"] = good
    qwen = fx / "good-qwen2.gguf"
    tl.write_tiny_gguf(qwen, "qwen2")
    out["good-qwen2.gguf"] = qwen
    hf = tb._tiny_hf_dir(fx, "goodhf")
    out["goodhf"] = hf
    raw = good.read_bytes()
    n = len(raw)

    def put(name, data):
        p = fx / name
        p.write_bytes(data)
        out[name] = p

    # where the header ends and the data starts
    r = gguf.GGUFReader(str(good))
    data_off = int(r.data_offset)
    tinfo = min(int(t.data_offset) for t in r.tensors)
    kv_end = None
    for t in r.tensors:
        i = raw.find(len(t.name.encode()).to_bytes(8, "little") + t.name.encode())
        kv_end = i if kv_end is None else min(kv_end, i)
    out["_offsets"] = {"size": n, "tensor_index": kv_end, "data": data_off}
    # truncations
    for off in sorted({0, 3, 4, 8, 16, 24, 40, 100, 1000, kv_end - 1, kv_end + 20, data_off - 8, data_off,
                       data_off + 1000, (data_off + n) // 2, n - 100, n - 1}):
        if 0 <= off < n:
            put(f"trunc-{off}.gguf", raw[:off])
    # byte flips
    rng = np.random.default_rng(0)
    regions = {"header": (0, 24), "kv": (24, kv_end), "index": (kv_end, data_off), "data": (data_off, n)}
    for reg, (a, b) in regions.items():
        for k in range(6 if reg != "header" else 8):
            pos = int(rng.integers(a, b))
            d = bytearray(raw)
            d[pos] ^= 0xFF if k % 2 == 0 else (1 << int(rng.integers(0, 8)))
            put(f"flip-{reg}-{pos}.gguf", bytes(d))
    # wrong metadata type / value
    def patch_kv(name, key, fn):
        d = bytearray(raw)
        kb = key.encode()
        i = d.index(len(kb).to_bytes(8, "little") + kb) + 8 + len(kb)
        fn(d, i)
        put(name, bytes(d))

    def set_type(t):
        return lambda d, i: d.__setitem__(slice(i, i + 4), int(t).to_bytes(4, "little"))

    V = gguf.GGUFValueType
    patch_kv("meta-blockcount-float.gguf", "llama.block_count", set_type(V.FLOAT32))
    patch_kv("meta-blockcount-bool.gguf", "llama.block_count", set_type(V.BOOL))
    patch_kv("meta-blockcount-string.gguf", "llama.block_count", set_type(V.STRING))
    patch_kv("meta-blockcount-badtype.gguf", "llama.block_count", set_type(99))
    patch_kv("meta-heads-0.gguf", "llama.attention.head_count", lambda d, i: d.__setitem__(slice(i + 4, i + 8), (0).to_bytes(4, "little")))
    patch_kv("meta-heads-3.gguf", "llama.attention.head_count", lambda d, i: d.__setitem__(slice(i + 4, i + 8), (3).to_bytes(4, "little")))
    patch_kv("meta-ctx-1.gguf", "llama.context_length", lambda d, i: d.__setitem__(slice(i + 4, i + 8), (1).to_bytes(4, "little")))
    patch_kv("meta-ctx-huge.gguf", "llama.context_length", lambda d, i: d.__setitem__(slice(i + 4, i + 8), (0xFFFFFFFF).to_bytes(4, "little")))
    patch_kv("meta-embd-huge.gguf", "llama.embedding_length", lambda d, i: d.__setitem__(slice(i + 4, i + 8), (1 << 30).to_bytes(4, "little")))
    patch_kv("meta-eps-nan.gguf", "llama.attention.layer_norm_rms_epsilon", lambda d, i: d.__setitem__(slice(i + 4, i + 8), np.float32("nan").tobytes()))
    patch_kv("meta-ropebase-inf.gguf", "llama.rope.freq_base", lambda d, i: d.__setitem__(slice(i + 4, i + 8), np.float32("inf").tobytes()))
    patch_kv("meta-ropebase-neg.gguf", "llama.rope.freq_base", lambda d, i: d.__setitem__(slice(i + 4, i + 8), np.float32(-1).tobytes()))
    patch_kv("meta-arch-len-huge.gguf", "general.architecture", lambda d, i: d.__setitem__(slice(i + 4, i + 12), (10**15).to_bytes(8, "little")))
    patch_kv("meta-arch-len-short.gguf", "general.architecture", lambda d, i: d.__setitem__(slice(i + 4, i + 12), (2).to_bytes(8, "little")))
    patch_kv("meta-tokens-count-huge.gguf", "tokenizer.ggml.tokens", lambda d, i: d.__setitem__(slice(i + 8, i + 16), (10**12).to_bytes(8, "little")))
    patch_kv("meta-tokens-count-small.gguf", "tokenizer.ggml.tokens", lambda d, i: d.__setitem__(slice(i + 8, i + 16), (10).to_bytes(8, "little")))
    patch_kv("meta-bos-huge.gguf", "tokenizer.ggml.bos_token_id", lambda d, i: d.__setitem__(slice(i + 4, i + 8), (10**9).to_bytes(4, "little")))
    patch_kv("meta-eos-huge.gguf", "tokenizer.ggml.eos_token_id", lambda d, i: d.__setitem__(slice(i + 4, i + 8), (10**9).to_bytes(4, "little")))
    patch_kv("meta-arch-bogus.gguf", "general.architecture", lambda d, i: d.__setitem__(slice(i + 12, i + 17), b"lxama"))
    d = bytearray(raw)
    d[8:16] = (10**12).to_bytes(8, "little")     # tensor count
    put("hdr-tensorcount-huge.gguf", bytes(d))
    d = bytearray(raw)
    d[16:24] = (10**12).to_bytes(8, "little")    # kv count
    put("hdr-kvcount-huge.gguf", bytes(d))
    d = bytearray(raw)
    d[4:8] = (99).to_bytes(4, "little")          # version
    put("hdr-version-99.gguf", bytes(d))
    d = bytearray(raw)
    d[0:4] = b"GGUG"
    put("hdr-magic.gguf", bytes(d))
    put("chained.gguf", raw + raw)
    put("trailing-junk.gguf", raw + os.urandom(777))
    # huge claimed tensor / array
    for nm, fn in (("huge-tensor.gguf", lambda p: tb._claim_huge_tensor(p, "token_embd.weight")),
                   ("huge-array.gguf", lambda p: tb._claim_huge_array(p, "tokenizer.ggml.token_type"))):
        p = fx / nm
        p.write_bytes(raw)
        fn(p)
        out[nm] = p
    # tensor offset beyond the file
    d = bytearray(raw)
    nm = b"blk.0.attn_q.weight"
    i = d.index(len(nm).to_bytes(8, "little") + nm) + 8 + len(nm)
    nd = int.from_bytes(d[i:i + 4], "little")
    j = i + 4 + 8 * nd + 4
    d[j:j + 8] = (10**10).to_bytes(8, "little")
    put("tensor-offset-beyond.gguf", bytes(d))
    d = bytearray(raw)
    d[i + 4 + 8 * nd:i + 4 + 8 * nd + 4] = (77).to_bytes(4, "little")   # ggml type
    put("tensor-type-bogus.gguf", bytes(d))
    d = bytearray(raw)
    d[i:i + 4] = (9).to_bytes(4, "little")        # n_dims
    put("tensor-ndims-9.gguf", bytes(d))
    # NaN / Inf weights
    tens = tl.hf_tensors("llama")
    for what, val in (("nan", float("nan")), ("inf", float("inf"))):
        for tname in ("model.layers.1.mlp.down_proj.weight", "model.norm.weight", "model.embed_tokens.weight"):
            t2 = dict(tens)
            x = t2[tname].clone()
            x.view(-1)[: max(1, x.numel() // 50)] = val
            t2[tname] = x
            short = tname.split(".")[-2]
            p = fx / f"weights-{what}-{short}.gguf"
            tl.write_tiny_gguf(p, "llama", tensors=t2, qtypes={})
            out[p.name] = p
            if tname.endswith("norm.weight"):
                dd = fx / f"hf-weights-{what}-{short}"
                shutil.copytree(hf, dd)
                save_file({k: v.contiguous() for k, v in t2.items()}, str(dd / "model.safetensors"))
                out[dd.name] = dd
    # odd path kinds
    (fx / "empty.gguf").write_bytes(b"")
    out["empty.gguf"] = fx / "empty.gguf"
    (fx / "adir.gguf").mkdir()
    out["adir.gguf"] = fx / "adir.gguf"
    os.mkfifo(fx / "fifo.gguf")
    out["fifo.gguf"] = fx / "fifo.gguf"
    os.symlink(fx / "loop2.gguf", fx / "loop1.gguf")
    os.symlink(fx / "loop1.gguf", fx / "loop2.gguf")
    out["loop1.gguf"] = fx / "loop1.gguf"
    os.symlink("/dev/zero", fx / "zero.gguf")
    out["zero.gguf"] = fx / "zero.gguf"
    p = fx / "noperm.gguf"
    p.write_bytes(raw)
    p.chmod(0)
    out["noperm.gguf"] = p
    (fx / "emptydir").mkdir()
    out["emptydir"] = fx / "emptydir"
    # HF dir damage
    st = (hf / "model.safetensors").read_bytes()
    hlen = int.from_bytes(st[:8], "little")
    for off in (0, 4, 8, 50, 8 + hlen - 1, 8 + hlen, 8 + hlen + 100, len(st) // 2, len(st) - 1):
        dd = fx / f"hf-trunc-{off}"
        shutil.copytree(hf, dd)
        (dd / "model.safetensors").write_bytes(st[:off])
        out[dd.name] = dd
    for k, pos in enumerate((0, 3, 9, 20, 8 + hlen // 2, 8 + hlen - 2, 8 + hlen + 10, len(st) - 10)):
        dd = fx / f"hf-flip-{pos}"
        shutil.copytree(hf, dd)
        b = bytearray(st)
        b[pos] ^= 0xFF
        (dd / "model.safetensors").write_bytes(bytes(b))
        out[dd.name] = dd
    dd = fx / "hf-header-len-huge"
    shutil.copytree(hf, dd)
    (dd / "model.safetensors").write_bytes((10**15).to_bytes(8, "little") + st[8:])
    out[dd.name] = dd
    dd = fx / "hf-dtype-wrong"
    shutil.copytree(hf, dd)
    save_file({k: (v.to(torch.int32) if "q_proj" in k else v).contiguous() for k, v in tens.items()},
              str(dd / "model.safetensors"))
    out[dd.name] = dd
    dd = fx / "hf-no-weights"
    shutil.copytree(hf, dd)
    (dd / "model.safetensors").unlink()
    out[dd.name] = dd
    dd = fx / "hf-weights-dir"
    shutil.copytree(hf, dd)
    (dd / "model.safetensors").unlink()
    (dd / "model.safetensors").mkdir()
    out[dd.name] = dd
    return out


def hf_side_variants(fx: Path, hf: Path):
    """HF directories with odd side files: {name: path}."""
    import copy

    cfg = json.loads((hf / "config.json").read_text())
    tokj = (hf / "tokenizer.json").read_text()
    out = {}

    def variant(name, files: dict, remove=()):
        d = fx / f"side-{name}"
        shutil.copytree(hf, d)
        for f in remove:
            (d / f).unlink()
        for f, content in files.items():
            if isinstance(content, bytes):
                (d / f).write_bytes(content)
            else:
                (d / f).write_text(content if isinstance(content, str) else json.dumps(content))
        out[name] = d

    def cfgw(**over):
        c = copy.deepcopy(cfg)
        for k, v in over.items():
            if v is ...:
                c.pop(k, None)
            else:
                c[k] = v
        return {"config.json": json.dumps(c)}

    deep = "[" * 100000 + "]" * 100000
    for nm, content in {"tc-list": [], "tc-string": "x", "tc-null": None, "tc-bad-json": "{", "tc-deep": deep,
                        "tc-bos-int": {"bos_token": 5}, "tc-eos-list": {"eos_token": ["a", "b"]},
                        "tc-eos-dict-bad": {"eos_token": {"content": 5}}, "tc-addbos-str": {"add_bos_token": "no"},
                        "tc-template-int": {"chat_template": 7}, "tc-template-list-bad": {"chat_template": [{"x": 1}]},
                        "tc-template-broken-jinja": {"chat_template": "{% for %}"},
                        "tc-template-raises": {"chat_template": "{{ raise_exception('boom') }}"},
                        "tc-maxlen-nan": '{"model_max_length": NaN}', "tc-bad-utf8": b"{\"eos_token\": \"\xff\xfe\"}",
                        "tc-added-tokens-garbage": {"added_tokens_decoder": {"x": 5}}}.items():
        body = content if isinstance(content, (str, bytes)) and nm in ("tc-bad-json", "tc-deep", "tc-maxlen-nan", "tc-bad-utf8", "tc-string") else json.dumps(content)
        variant(nm, {"tokenizer_config.json": body})
    for nm, content in {"gc-list": "[]", "gc-bad-json": "{x", "gc-eos-str": {"eos_token_id": "2"},
                        "gc-eos-huge": {"eos_token_id": 10**12}, "gc-eos-neg": {"eos_token_id": -1},
                        "gc-eos-list-mixed": {"eos_token_id": [2, "x", None]}, "gc-eos-bool": {"eos_token_id": True},
                        "gc-eos-float": {"eos_token_id": 2.5}, "gc-temp-nan": '{"temperature": NaN}',
                        "gc-deep": deep}.items():
        variant(nm, {"generation_config.json": content if isinstance(content, str) else json.dumps(content)})
    for nm, over in {"cfg-sliding-1": dict(sliding_window=1), "cfg-sliding-0": dict(sliding_window=0),
                     "cfg-sliding-str": dict(sliding_window="4096"), "cfg-sliding-neg": dict(sliding_window=-5),
                     "cfg-sliding-float": dict(sliding_window=64.0), "cfg-sliding-big": dict(sliding_window=10**9),
                     "cfg-layers-str": dict(num_hidden_layers="4"), "cfg-layers-float": dict(num_hidden_layers=4.0),
                     "cfg-layers-bool": dict(num_hidden_layers=True), "cfg-heads-missing": dict(num_attention_heads=...),
                     "cfg-vocab-small": dict(vocab_size=10), "cfg-vocab-big": dict(vocab_size=10**6),
                     "cfg-eps-str": dict(rms_norm_eps="1e-5"), "cfg-theta-0": dict(rope_theta=0),
                     "cfg-theta-list": dict(rope_theta=[1]), "cfg-rope-scaling-str": dict(rope_scaling="llama3"),
                     "cfg-rope-scaling-yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4}),
                     "cfg-rope-scaling-llama3-missing": dict(rope_scaling={"rope_type": "llama3", "factor": 8}),
                     "cfg-rope-scaling-llama3-nan": dict(rope_scaling={"rope_type": "llama3", "factor": float("nan"), "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 64}),
                     "cfg-tie-str": dict(tie_word_embeddings="false"), "cfg-model-type-int": dict(model_type=3),
                     "cfg-model-type-gemma": dict(model_type="gemma"), "cfg-maxpos-1": dict(max_position_embeddings=1),
                     "cfg-head-dim-odd": dict(head_dim=15), "cfg-kvheads-3": dict(num_key_value_heads=3),
                     "cfg-bias-str": dict(attention_bias="yes"), "cfg-torch-dtype-bogus": dict(torch_dtype="int3")}.items():
        variant(nm, cfgw(**over))
    variant("cfg-list", {"config.json": "[]"})
    variant("cfg-bad-json", {"config.json": "{\"model_type\": "})
    variant("cfg-nan-literal", {"config.json": json.dumps(cfg).replace("50000.0", "NaN")})
    variant("cfg-deep", {"config.json": deep})
    variant("cfg-bad-utf8", {"config.json": json.dumps(cfg).encode()[:-1] + b"\xff}"})
    variant("cfg-missing", {}, remove=("config.json",))
    # sharded: index pointing at missing / odd shards
    st = "model.safetensors"
    names = [k for k in json.loads((hf / st).read_bytes()[8:8 + int.from_bytes((hf / st).read_bytes()[:8], "little")]) if k != "__metadata__"]
    idx_ok = {"weight_map": {k: st for k in names}}
    variant("idx-ok", {"model.safetensors.index.json": json.dumps(idx_ok)})
    variant("idx-missing-shard", {"model.safetensors.index.json": json.dumps({"weight_map": {k: "nope.safetensors" for k in names}})})
    variant("idx-traversal", {"model.safetensors.index.json": json.dumps({"weight_map": {k: "../../../../etc/passwd" for k in names}})})
    variant("idx-list", {"model.safetensors.index.json": "[]"})
    variant("idx-map-list", {"model.safetensors.index.json": json.dumps({"weight_map": []})})
    variant("idx-map-int-values", {"model.safetensors.index.json": json.dumps({"weight_map": {k: 5 for k in names}})})
    variant("idx-bad-json", {"model.safetensors.index.json": "{"})
    variant("idx-partial-map", {"model.safetensors.index.json": json.dumps({"weight_map": {names[0]: st}})})
    variant("tok-bad-json", {"tokenizer.json": "{"})
    variant("tok-empty", {"tokenizer.json": ""})
    variant("tok-list", {"tokenizer.json": "[]"})
    variant("tok-missing", {}, remove=("tokenizer.json",))
    variant("tok-deep", {"tokenizer.json": deep})
    variant("tok-vocab-bigger", {"tokenizer.json": tokj.replace('"w0":', '"w999999": 999999, "w0":')})
    variant("tok-truncated", {"tokenizer.json": tokj[: len(tokj) // 2]})
    return out


# ------------------------------------------------------------------------------------------------ case lists
def file_cases(fx: dict) -> list:
    cases = []
    for name, p in fx.items():
        if name.startswith("_"):
            continue
        if name == "noperm.gguf" and os.geteuid() == 0:
            continue   # root reads it anyway
        code = f"res = load_check({str(p)!r})"
        if name == "hf-dtype-wrong":   # int32 q_proj weights: loading them as numbers is not a checkpoint
            code += "\nres = ('silently wrong', 'int32 q_proj weights accepted; ' + res[1]) if res[0] == 'correct' else res"
        cases.append(Case("1 model files", f"load:{name}",
                          f"python -c \"import swiftk; e=swiftk.load('{p}'); e.generate('the the', max_new_tokens=8)\"",
                          code=code, timeout=60 if "fifo" not in name else 30, shared=True))
    return cases


def side_cases(variants: dict) -> list:
    cases = []
    for name, p in variants.items():
        code = f"res = load_check({str(p)!r})"
        if name.startswith("tc-template") or name.startswith("tc-"):
            code = (f"res = load_check({str(p)!r})\n"
                    f"e = swiftk.load({str(p)!r})\n"
                    f"if e.tokenizer.chat_template:\n"
                    f"    e.generate('w1 w2', max_new_tokens=4, chat=True)\n")
        cases.append(Case("2 HF side files", f"side:{name}", f"python -c \"import swiftk; swiftk.load('{p}')\"",
                          code=code, timeout=60, shared=True))
    return cases


def home_cases(model: Path, homes) -> list:
    """$SWIFTK_HOME damage: each run twice (two processes); the second must work."""
    gen = ["generate", PROMPT, "-n", str(NTOK), "--json"]

    def state_writer(content):
        def setup(home):
            path = home / homes.state_rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if content is None:
                path.mkdir(parents=True, exist_ok=True)
            else:
                path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return setup

    def valid_state_then(fn):
        def setup(home):
            path = home / homes.state_rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(fn(homes.state_text))
        return setup

    cases = []
    reprod = "SWIFTK_HOME=$H swiftk generate 'def fib(n):' -n 16 --json  (twice)"
    for nm, content in {"nan": '{"version": NaN}', "infinity-text": '{"skip_set": Infinity}', "list": "[]",
                        "truncated": '{"version": 1, "sk', "bad-utf8": b'{"a": "\xff"}',
                        "deep": "[" * 100000 + "]" * 100000, "dir": None}.items():
        cases.append(Case("3 SWIFTK_HOME", f"state:{nm}", reprod, kind="cli", argv=["-m", "smollm2-135m"] and
                          [gen[0], gen[1], "-m", "smollm2-135m", *gen[2:]], setup=state_writer(content), twice=True,
                          check=ar_check))

    import re

    def sub_nums(txt, val):
        return re.sub(r'(?<=": )-?\d+\.\d+(e-?\d+)?', val, txt, count=3)

    for nm, fn in {"floats-nan": lambda t: sub_nums(t, "NaN"), "floats-inf": lambda t: sub_nums(t, "Infinity"),
                   "floats-neg": lambda t: sub_nums(t, "-1e308"),
                   "ints-to-str": lambda t: re.sub(r'(?<=": )(\d+)(?=[,\n])', r'"\1"', t, count=5),
                   "lists-to-null": lambda t: re.sub(r'\[[^\[\]]*\]', "null", t, count=3),
                   "other-model-layers": lambda t: t.replace("true", "true, true", 1)}.items():
        cases.append(Case("3 SWIFTK_HOME", f"state-edit:{nm}", reprod, kind="cli",
                          argv=[gen[0], gen[1], "-m", "smollm2-135m", *gen[2:]], setup=valid_state_then(fn),
                          twice=True, check=ar_check))

    def so_damage(fn):
        def setup(home):
            for so in (home / "kernels").glob("*.so"):
                fn(so)
        return setup

    def trunc(p):
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])

    def flip(p):
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 0xFF
        b[100] ^= 0xFF
        p.write_bytes(bytes(b))

    def other_so(p):
        import _ctypes
        shutil.copy(_ctypes.__file__, p)

    def elf_header_only(p):
        p.write_bytes(p.read_bytes()[:64])

    for nm, fn in {"truncated": trunc, "flipped": flip, "empty": lambda p: p.write_bytes(b""),
                   "other-so": other_so, "dir": lambda p: (p.unlink(), p.mkdir())}.items():
        cases.append(Case("3 SWIFTK_HOME", f"kernel-so:{nm}",
                          reprod.replace("(twice)", "(twice, SWIFTK_CPU_KERNELS=build; damage $SWIFTK_KERNEL_CACHE/*.so first)"),
                          kind="cli", argv=[gen[0], gen[1], "-m", "smollm2-135m", *gen[2:]], setup=so_damage(fn),
                          twice=True, check=ar_check, timeout=300, env=BUILD))
    # the first-use build interrupted: one clean line or death, no compiler left running, no temp file left once a
    # later load has run (it sweeps the dead writer's), and that load builds and decodes correctly
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        cases.append(Case("3 SWIFTK_HOME", f"kernel-build:{sig.name}",
                          f"SWIFTK_CPU_KERNELS=build, empty kernel cache; kill -{sig.name} 8 s into the compile, run again",
                          kind="cli", argv=[gen[0], gen[1], "-m", "smollm2-135m", *gen[2:]],
                          setup=lambda h: shutil.rmtree(h / "kernels", ignore_errors=True), twice=True,
                          signal_after=(sig, 8), signal_once=True, check=ar_check, timeout=400, env=BUILD))

    def ds_damage(fn):
        def setup(home):
            for f in (home / "datastore").glob("*"):
                fn(f)
        return setup

    for nm, fn in {"truncated": trunc, "flipped": flip, "dir": lambda p: (p.unlink(), p.mkdir())}.items():
        cases.append(Case("3 SWIFTK_HOME", f"datastore:{nm}", reprod, kind="cli",
                          argv=[gen[0], gen[1], "-m", "smollm2-135m", *gen[2:]], setup=ds_damage(fn), twice=True,
                          check=ar_check, timeout=300))

    def dv_damage(fn):
        def setup(home):
            for f in (home / "draft_vocab").rglob("*.json"):
                fn(f)
        return setup

    for nm, fn in {"truncated": trunc, "nan": lambda p: p.write_text('{"tokens": [NaN]}'), "list": lambda p: p.write_text("[1, 2, -5]")}.items():
        cases.append(Case("3 SWIFTK_HOME", f"draft-vocab:{nm}", reprod, kind="cli",
                          argv=[gen[0], gen[1], "-m", "smollm2-135m", *gen[2:]], setup=dv_damage(fn), twice=True,
                          check=ar_check, timeout=300))

    def marker(fn):
        def setup(home):
            fn(home / "models" / (model.name + ".verified"))
        return setup

    for nm, fn in {"marker-garbage": lambda p: (p.unlink(), p.write_text("garbage")),
                   "marker-dir": lambda p: (p.unlink(), p.mkdir())}.items():
        cases.append(Case("3 SWIFTK_HOME", f"models:{nm}", reprod, kind="cli",
                          argv=[gen[0], gen[1], "-m", "smollm2-135m", *gen[2:]], setup=marker(fn), twice=True,
                          check=ar_check, timeout=300))

    def readonly(home):
        for dp, dn, fnames in os.walk(home):
            os.chmod(dp, 0o555)

    if os.geteuid() != 0:
        cases.append(Case("3 SWIFTK_HOME", "read-only-home", reprod, kind="cli",
                          argv=[gen[0], gen[1], "-m", "smollm2-135m", *gen[2:]], setup=readonly, check=ar_check))
    cases.append(Case("3 SWIFTK_HOME", "home-is-file", "SWIFTK_HOME=/etc/hostname swiftk generate x -n 4", kind="cli",
                      argv=["generate", "x", "-n", "4"], env={"SWIFTK_HOME": "/etc/hostname"}))
    cases.append(Case("3 SWIFTK_HOME", "state-dir-is-file", reprod, kind="cli",
                      argv=[gen[0], gen[1], "-m", "smollm2-135m", *gen[2:]],
                      setup=lambda h: (h / "state").write_text("x"), check=ar_check))
    cases.append(Case("3 SWIFTK_HOME", "kernel-cache-is-file", reprod, kind="cli",
                      argv=[gen[0], gen[1], "-m", "smollm2-135m", *gen[2:]],
                      setup=lambda h: (shutil.rmtree(h / "kernels"), (h / "kernels").write_text("x")), check=ar_check,
                      timeout=300, env=BUILD))
    return cases


AR_TEXT = {}


def ar_check(out, err):
    """CLI --json output against the autoregressive reference."""
    try:
        d = json.loads(out)
    except ValueError:
        return "silently wrong", f"exit 0 but stdout is not JSON: {out[:120]!r}"
    if d.get("token_ids") != AR_TEXT.get("ids"):
        return "silently wrong", f"token ids differ from autoregressive: {d.get('token_ids', [])[:10]}"
    return "correct", "exit 0, output equals autoregressive"


def api_cases() -> list:
    """Bad API input on one shared engine (each case followed by a health check on it)."""
    C = []

    def add(name, code, shared=True, timeout=60):
        C.append(Case("4 API", name, f"python -c \"import swiftk; e=swiftk.load(M); {code.strip().splitlines()[0][:150]}\"",
                      code=textwrap.dedent(code), shared=shared, timeout=timeout))

    weird = {"str": "'3'", "float": "3.5", "nan": "float('nan')", "inf": "float('inf')", "neg": "-1", "bool": "True",
             "huge": "10**30", "none": "None", "list": "[1]", "zero": "0"}
    gen_args = {"max_new_tokens": None, "temperature": None, "top_k": None, "top_p": None, "seed": None,
                "exit_layer": None, "method": None}
    for arg in gen_args:
        for wn, wv in weird.items():
            extra = ", method='early_exit'" if arg == "exit_layer" else ""
            if arg == "method" and wn not in ("str", "none", "list", "bool"):
                continue
            add(f"generate:{arg}={wn}", f"res = vs_ar(E(), **{{{arg!r}: {wv}}}{extra})")
    # decode / optimizer options from the option metadata
    from swiftk.options import DecodeConfig, OptimizerConfig
    from dataclasses import fields

    for f in fields(DecodeConfig):
        kind = f.metadata.get("kind")
        vals = {"str": "'x'", "nan": "float('nan')", "neg": "-1", "huge": "10**30", "none": "None", "bool-as-int": "1" if kind is bool else "True"}
        if kind == "bins":
            vals = {"empty": "()", "nan": "((float('nan'), 3),)", "neg-k": "((0.5, -1),)", "str": "'abc'", "nested-bad": "((0.5,),)", "bool-k": "((0.5, True),)"}
        for wn, wv in vals.items():
            add(f"decode:{f.name}={wn}", f"res = vs_ar(E(), **{{{f.name!r}: {wv}}})")
    for f in fields(OptimizerConfig):
        for wn, wv in {"nan": "float('nan')", "str": "'x'", "neg": "-1", "bool": "True", "huge": "10**30"}.items():
            add(f"optimizer-opt:{f.name}={wn}", f"try:\n    E().reset_optimizer(**{{{f.name!r}: {wv}}})\n    res = vs_ar(E())\n"
                f"finally:\n    E().reset_optimizer()")
    for kw in ("skip_ratio=float('nan')", "objective='x'", "context_window=True"):
        add(f"load-opt:{kw}", f"e = swiftk.load(M, persist=False, {kw})\nres = vs_ar(e)", shared=False)
    # valid but unusual option values: must not change greedy output
    for kw in ("max_draft=1", "max_draft=64", "max_tree_nodes=2", "max_tree_nodes=64", "speculate='always'",
               "kvq=True", "ngram=False", "history=False", "datastore=False", "draft_vocab=0", "draft_vocab=1",
               "draft_vocab=10**9", "optimize=False", "eps=0.0", "eps=1.0", "sampling='rejection'", "trace=True",
               "topk_greedy=((0.0, 1),)", "topk_greedy=[[0.0, 64]]"):
        add(f"valid:{kw}", f"res = vs_ar(E(), {kw})")
    for m in ("ngram", "swift"):
        for kw in ("temperature=0.7, seed=3", "temperature=1.0, top_k=5, seed=1", "temperature=0.5, top_p=0.9, seed=2",
                   "temperature=1e-6, seed=0", "temperature=100.0, seed=0"):
            add(f"sampling:{m}:{kw}", f"res = vs_ar(E(), method={m!r}, {kw})")
    add("sampling:no-seed-twice-differs?", "a = E().generate(PROMPT, max_new_tokens=16, temperature=1.0).token_ids\n"
        "b = E().generate(PROMPT, max_new_tokens=16, temperature=1.0).token_ids\nres = ('correct', f'unseeded sampling; same={a==b}')")
    add("load:max_context=1", "swiftk.load(M, max_context=1)", shared=False)
    add("load:max_context=huge", "swiftk.load(M, max_context=10**9)", shared=False)
    add("load:max_context=nan", "swiftk.load(M, max_context=float('nan'))", shared=False)
    add("load:device=cuda:9", "swiftk.load(M, device='cuda:9')", shared=False)
    add("load:device=bogus", "swiftk.load(M, device='tpu')", shared=False)
    add("load:dtype=int8", "swiftk.load(M, dtype='int8')", shared=False)
    add("load:weights=fp4", "swiftk.load(M, weights='fp4')", shared=False)
    add("load:weights=int8", "e = swiftk.load(M, weights='int8', persist=False)\nres = vs_ar(e)", shared=False, timeout=180)
    add("load:drafter=missing", "swiftk.load(M, drafter='/nonexistent.pt')", shared=False)
    add("load:drafter=garbage", "open('d.pt','wb').write(b'garbage')\ne = swiftk.load(M, drafter='d.pt', persist=False)\nres = vs_ar(e, method='moa')", shared=False)
    add("load:unknown-option", "swiftk.load(M, skip_ration=0.3)", shared=False)
    add("load:model=None", "swiftk.load(None)", shared=False)
    add("load:model=int", "swiftk.load(5)", shared=False)
    add("load:model=unknown-name", "swiftk.load('llama-9000')", shared=False)
    add("load:model=empty", "swiftk.load('')", shared=False)
    add("load:model=nul-byte", "swiftk.load('a\\x00b.gguf')", shared=False)
    add("load:model=surrogate", "swiftk.load('\\udcff.gguf')", shared=False)
    # prompts
    for nm, pr in {"empty": "''", "space": "' '", "none": "None", "bytes": "b'abc'", "int": "5", "bool": "True",
                   "list-empty": "[]", "ids-neg": "[-1]", "ids-huge": "[10**9]", "ids-bools": "[True, False]",
                   "ids-floats": "[1.0, 2.0]", "ids-mixed": "[1, 'a']", "ids-numpy": "__import__('numpy').array([1,2,3])",
                   "ids-tensor": "__import__('torch').tensor([1,2,3])", "lone-surrogate": "'abc\\udc80def'",
                   "nul": "'a\\x00b'", "huge-text": "'hello ' * 20000", "emoji": "'🙂' * 50",
                   "dict": "{'role': 'user'}", "ids-tuple": "(1, 2, 3)"}.items():
        add(f"prompt:{nm}", f"res = vs_ar(E(), {pr}, 8)")
    for nm, pr in {"chat-msgs-bad-role": "[{'role': 'wizard', 'content': 'hi'}]", "chat-msgs-no-content": "[{'role': 'user'}]",
                   "chat-content-int": "[{'role': 'user', 'content': 5}]", "chat-empty-list": "[]",
                   "chat-str": "'hello'", "chat-nested": "[[{'role': 'user', 'content': 'x'}]]"}.items():
        add(f"prompt:{nm}", f"res = vs_ar(E(), {pr}, 8, chat=True)")
    add("prompt:fills-context", "e = swiftk.load(M, max_context=64, persist=False)\nres = vs_ar(e, list(range(1, 60)), 10)", shared=False)
    add("prompt:exactly-context", "e = swiftk.load(M, max_context=64, persist=False)\nres = vs_ar(e, list(range(1, 65)), 1)", shared=False)
    add("max_new_tokens=0", "res = vs_ar(E(), n=0)")
    # stop strings
    for nm, st in {"empty": "''", "list-empty-str": "['']", "none-in-list": "[None]", "int": "5", "dict": "{'a': 1}",
                   "bytes": "b'x'", "huge-list": "['zzz%d' % i for i in range(10000)]", "newline": "'\\n'",
                   "surrogate": "'\\udc80'", "set": "{'\\n'}", "long": "'x' * 100000"}.items():
        add(f"stop:{nm}", f"res = vs_ar(E(), stop={st})")
    # callbacks
    add("callback:raises", "def cb(p):\n    raise UserBoom('cb')\nE().generate(PROMPT, max_new_tokens=8, callback=cb)")
    add("callback:raises-keyboardinterrupt", "def cb(p):\n    raise KeyboardInterrupt\ntry:\n    E().generate(PROMPT, max_new_tokens=8, callback=cb)\nexcept KeyboardInterrupt:\n    res = ('clear error', 'KeyboardInterrupt propagated')")
    add("callback:systemexit", "def cb(p):\n    raise SystemExit(3)\ntry:\n    E().generate(PROMPT, max_new_tokens=8, callback=cb)\nexcept SystemExit:\n    res = ('clear error', 'SystemExit propagated')")
    add("callback:reenters-generate", "def cb(p):\n    E().generate('x', max_new_tokens=2)\nE().generate(PROMPT, max_new_tokens=8, callback=cb)")
    add("callback:reenters-logits", "def cb(p):\n    E().logits([1, 2])\nE().generate(PROMPT, max_new_tokens=8, callback=cb)")
    add("callback:reenters-stream", "def cb(p):\n    list(E().stream('x', max_new_tokens=2))\nE().generate(PROMPT, max_new_tokens=8, callback=cb)", timeout=40)
    add("callback:returns-garbage", "res = vs_ar(E(), callback=lambda p: object())")
    add("callback:not-callable", "E().generate(PROMPT, callback=5)")
    # the user's own callback raising: its exception propagates unchanged (as callback:raises), engine still usable
    add("callback:wrong-arity", "try:\n    E().generate(PROMPT, max_new_tokens=4, callback=lambda: None)\nexcept TypeError:\n"
        "    res = vs_ar(E())")
    add("callback:slow", "import time\nres = vs_ar(E(), callback=lambda p: time.sleep(0.05))")
    # proposers
    for nm, body in {"neg": "return [-1]", "huge": "return [10**9]", "str": "return 'abc'", "none": "return None",
                     "raises": "raise UserBoom('p')", "bools": "return [True, False]", "floats": "return [1.5, 2.0]",
                     "long": "return list(range(1, 5000))", "nan": "return [float('nan')]", "numpy": "import numpy; return numpy.array([5, 6])",
                     "tensor": "import torch; return torch.tensor([5, 6])", "generator": "return (i for i in [5, 6])",
                     "mutates": "tokens.clear(); return [5]", "dict": "return {1: 2}", "vocab-edge": "return [49151, 49152]",
                     "right-answer": "return [E().tokenizer.encode('\\n    if')[0]]"}.items():
        add(f"proposer:{nm}", f"class P:\n    def propose(self, tokens):\n        {body}\nres = vs_ar(E(), proposers=[P()])")
    add("proposer:no-propose", "res = vs_ar(E(), proposers=[object()])")
    add("proposer:not-list", "res = vs_ar(E(), proposers=5)")
    add("proposer:with-autoregressive", "class P:\n    def propose(self, t):\n        return [5]\nres = vs_ar(E(), method='autoregressive', proposers=[P()])")
    add("proposer:with-sampling-rejection", "class P:\n    def propose(self, t):\n        return [5]\nres = vs_ar(E(), proposers=[P()], temperature=0.8, seed=1, sampling='rejection')")
    # skip sets / state
    for nm, ss in {"dict-empty": "{}", "dict-bad-layer": "{'attention': [99], 'mlp': []}", "dict-neg": "{'attention': [-1], 'mlp': []}",
                   "tensor-wrong-len": "__import__('torch').zeros(3, dtype=__import__('torch').bool)", "str-missing": "'/nonexistent.json'",
                   "all-skipped": "{'attention': list(range(30)), 'mlp': list(range(30))}", "int": "5",
                   "float-tensor": "__import__('torch').zeros(60)"}.items():
        add(f"skip_set:{nm}", f"res = vs_ar(E(), method='static', skip_set={ss})")
    add("skip_set:with-ngram", "res = vs_ar(E(), method='ngram', skip_set={'attention': [1], 'mlp': []})")
    add("skip_set:with-autoregressive", "res = vs_ar(E(), method='autoregressive', skip_set={'attention': [1], 'mlp': []})")
    add("exit_layer:with-swift", "res = vs_ar(E(), exit_layer=3)")
    add("exit_layer:31", "res = vs_ar(E(), method='early_exit', exit_layer=31)")
    add("exit_layer:30", "res = vs_ar(E(), method='early_exit', exit_layer=30)")
    add("state:wrong-type", "res = vs_ar(E(), state={})")
    add("state:other-engine-ok", "res = vs_ar(E(), state=E().new_state())")
    add("skip_set-setter:garbage", "E().skip_set = 'abc'")
    add("reset_optimizer:bad", "E().reset_optimizer(skip_ratio=2)")
    add("logits:empty", "E().logits([])")
    add("logits:bools", "E().logits([True])")
    add("logits:too-long", "E().logits(list(range(5000)))")
    add("logits:str", "E().logits('abc')")
    add("logits:matches-generate", "import torch\nids = E().encode_prompt(PROMPT)\nlg = E().logits(ids)\n"
        "res = ('correct' if int(lg[-1].argmax()) == REF()[0] else 'silently wrong', f'argmax {int(lg[-1].argmax())} vs {REF()[0]}')")
    add("save_skip_set:dir", "E().states.save_skip_set('/')")
    add("save_skip_set:missing-dir", "E().states.save_skip_set('/nonexistent/x.json')")
    add("read_skip_set:garbage", "open('s.json','w').write('{\"attention\": NaN}')\nE().states.read_skip_set('s.json')")
    add("use_corpus:wrong", "E().use_corpus([1,2,3])")
    add("module-generate:bad-model", "swiftk.generate('x', model='/nonexistent.gguf')")
    add("module-generate:ok", f"out = swiftk.generate(PROMPT, model=M, max_new_tokens=NTOK, persist=False)\nres = same(out.token_ids, REF())")
    # threads and streams
    for k in (2, 3, 4):
        add(f"threads:{k}", f"import threading\nouts = [None] * {k}\nerrs = []\n"
            f"def w(i):\n    try:\n        outs[i] = E().generate(PROMPT, max_new_tokens=NTOK).token_ids\n    except Exception as e:\n        errs.append(repr(e))\n"
            f"ts = [threading.Thread(target=w, args=(i,)) for i in range({k})]\n[t.start() for t in ts]\n[t.join(60) for t in ts]\n"
            f"bad = [o for o in outs if o != REF()]\nres = ('silently wrong', f'{{len(bad)}} of {k} differ; errors {{errs[:2]}}') if bad or errs else ('correct', 'all threads equal the reference')")
    add("threads:mixed-methods", "import threading\nouts = {}\n"
        "def w(m):\n    outs[m] = E().generate(PROMPT, max_new_tokens=NTOK, method=m).token_ids\n"
        "ts = [threading.Thread(target=w, args=(m,)) for m in ('swift', 'ngram', 'autoregressive', 'early_exit' and 'swift')]\n"
        "[t.start() for t in ts]\n[t.join(60) for t in ts]\nbad = {m: o for m, o in outs.items() if o != REF()}\n"
        "res = ('silently wrong', str(bad)[:200]) if bad or len(outs) < 3 else ('correct', 'all equal')")
    add("threads:stream+generate", "import threading\nouts = []\n"
        "t = threading.Thread(target=lambda: outs.append(''.join(E().stream(PROMPT, max_new_tokens=NTOK))))\nt.start()\n"
        "g = E().generate(PROMPT, max_new_tokens=NTOK)\nt.join(60)\nref = E().tokenizer.decode(REF())\n"
        "res = ('correct', 'ok') if g.token_ids == REF() and outs and outs[0] == g.text else ('silently wrong', f'{outs[:1]!r} / {g.text!r}')")
    add("stream:abandoned", "it = E().stream(PROMPT, max_new_tokens=200)\nnext(it)\ndel it\nimport gc; gc.collect()\n"
        "res = same(E().generate(PROMPT, max_new_tokens=NTOK).token_ids, REF())")
    add("stream:abandoned-no-gc", "it = E().stream(PROMPT, max_new_tokens=200)\nnext(it)\nkeep = it\n"
        "res = same(E().generate(PROMPT, max_new_tokens=NTOK).token_ids, REF())", timeout=60)
    add("stream:close", "it = E().stream(PROMPT, max_new_tokens=200)\nnext(it)\nit.close()\n"
        "res = same(E().generate(PROMPT, max_new_tokens=NTOK).token_ids, REF())")
    add("stream:equals-generate", "s = ''.join(E().stream(PROMPT, max_new_tokens=NTOK))\n"
        "t = E().tokenizer.decode(REF())\nres = ('correct', 'same') if s == t else ('silently wrong', f'{s!r} vs {t!r}')")
    add("stream:bad-option", "list(E().stream(PROMPT, max_new_tokens=-1))")
    add("stream:never-iterated", "it = E().stream(PROMPT, max_new_tokens=50)\nres = same(E().generate(PROMPT, max_new_tokens=NTOK).token_ids, REF())", timeout=60)
    add("stream:callback-kw", "list(E().stream(PROMPT, max_new_tokens=4, callback=print))")
    return C


def batch_cases() -> list:
    """generate_many on a fresh engine (its first rounds had no timed step to price drafts with), its proposers, and
    the KV memory it asks for; each case on an engine of its own."""
    C = []

    def add(name, code, timeout=180):
        C.append(Case("7 batch", name, f"python -c \"import swiftk; e=swiftk.load(M); {code.strip().splitlines()[0][:150]}\"",
                      code=textwrap.dedent(code), shared=False, timeout=timeout))

    two = "P2 = [PROMPT, 'for i in range(10):\\n    print(i)\\nfor i in range(10):\\n    print(i)\\n']\n"
    check = ("ar = [e.generate(p, max_new_tokens=24, method='autoregressive').token_ids for p in P2]\n"
             "rounds = sum(o.stats.rounds for o in outs)\n"
             "res = ('silently wrong', f'{rounds} draft rounds') if not rounds else "
             "('silently wrong', 'differs from autoregressive') if [o.token_ids for o in outs] != ar else "
             "('correct', f'{rounds} draft rounds, equal to autoregressive')")
    for nm, kw in {"always": "speculate='always'", "ngram": "method='ngram'", "default": ""}.items():
        add(f"fresh:{nm}-drafts", two + f"e = swiftk.load(M, persist=False)\n"
            f"outs = e.generate_many(P2, max_new_tokens=24, {kw})\n" + check)
    add("fresh:proposer-consulted", two + "class P:\n    n = 0\n    def propose(self, t):\n        self.n += 1\n"
        "        return t[-6:]\np = P()\ne = swiftk.load(M, persist=False)\n"
        "outs = e.generate_many(P2, max_new_tokens=24, proposers=[p])\n"
        "res = ('correct', f'consulted {p.n} times') if p.n else ('silently wrong', 'the proposer was never consulted')")
    add("fresh:proposer-raises", two + "class P:\n    def propose(self, t):\n        raise UserBoom('p')\n"
        "e = swiftk.load(M, persist=False)\nouts = e.generate_many(P2, max_new_tokens=24, proposers=[P()])\n"
        "res = ('silently wrong', 'a raising proposer went unnoticed')")
    add("fresh:proposer-keyboardinterrupt", two + "class P:\n    def propose(self, t):\n        raise KeyboardInterrupt\n"
        "e = swiftk.load(M, persist=False)\ntry:\n    e.generate_many(P2, max_new_tokens=24, proposers=[P()])\n"
        "    res = ('silently wrong', 'KeyboardInterrupt went unnoticed')\nexcept KeyboardInterrupt:\n"
        "    res = ('clear error', 'KeyboardInterrupt propagated')")
    add("fresh:proposer-reenters", two + "e = swiftk.load(M, persist=False)\nclass P:\n    def propose(self, t):\n"
        "        return e.generate('x', max_new_tokens=2).token_ids\n"
        "outs = e.generate_many(P2, max_new_tokens=24, proposers=[P()])\n"
        "res = ('silently wrong', 'a re-entering proposer went unnoticed')")
    add("memory:six-prompts-max_batch=64", "import resource\ne = swiftk.load(M, persist=False)\n"
        "outs = e.generate_many([PROMPT] * 6, max_new_tokens=8, max_batch=64)\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\nroom = 6 * e.slots.slot_bytes + (2 << 30)\n"
        "res = ('correct', f'peak {peak >> 20} MiB') if peak < room else ('silently wrong', f'peak {peak >> 20} MiB for 6 prompts')")
    for nm, cap in {"8GiB": 8 << 30, "4GiB": 4 << 30}.items():
        add(f"memory:max_batch=64-under-{nm}-cap", f"import resource\ne = swiftk.load(M, persist=False)\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({cap}, resource.RLIM_INFINITY))\n"
            f"outs = e.generate_many([PROMPT] * 64, max_new_tokens=4, max_batch=64)\n"
            f"res = ('correct', 'fitted')")
        add(f"memory:server-max_batch=64-under-{nm}-cap", f"import resource\nfrom swiftk.serve.app import Server\n"
            f"e = swiftk.load(M, persist=False)\nresource.setrlimit(resource.RLIMIT_AS, ({cap}, resource.RLIM_INFINITY))\n"
            f"srv = Server(e, 'm', max_batch=64)\nsrv.decoder.close()\nres = ('correct', 'fitted')")
    return C


def kernel_manifest_cases() -> list:
    """The installed kernel library's manifest damaged in shape (a copy of the install folder, pointed at): the load
    falls back to a library built for the machine, with a warning naming the file."""
    C = []
    copy = ("import json, shutil\nfrom pathlib import Path\nfrom swiftk.runtime.ops import native\n"
            "shutil.copytree(native.INSTALLED, 'inst')\nm = json.loads(Path('inst/manifest.json').read_text())\n")
    tail = ("Path('inst/manifest.json').write_text(json.dumps(m))\nnative.INSTALLED = Path('inst').resolve()\n"
            "e = swiftk.load(M, persist=False)\nres = vs_ar(e)")
    shapes = {"variants-list": "m['variants'] = list(m['variants'])", "variants-str": "m['variants'] = 'native'",
              "variants-int": "m['variants'] = 5", "entry-str": "m['variants'] = {k: 'x.so' for k in m['variants']}",
              "entry-list": "m['variants'] = {k: [v] for k, v in m['variants'].items()}",
              "entry-null-file": "m['variants'] = {k: {**v, 'file': None} for k, v in m['variants'].items()}",
              "manifest-list": "m = [m]", "sources-dict": "m['sources'] = {}"}
    for nm, edit in shapes.items():
        # loaded from the install (not $H/kernels), as a user's would be; the fallback build is cached in $H/kernels
        C.append(Case("8 kernels", f"manifest:{nm}", f"edit swiftk/_native/manifest.json: {edit}",
                      code=copy + edit + "\n" + tail, shared=False, timeout=300))
    return C


EXIT_SCRIPT = """import subprocess, sys
code = {body!r}
rcs = []
for _ in range(4):   # the abort came in ~80% of runs
    r = subprocess.run([sys.executable, '-c', code, M], capture_output=True, text=True, timeout=200)
    rcs.append((r.returncode, 'terminate called' in r.stderr))
bad = [x for x in rcs if x[0] != 0 or x[1]]
res = ('crash', f'exits (rc, aborted): {{rcs}}') if bad else ('correct', 'exit 0 each time')
"""
EXIT_PRELUDE = "import sys, threading, swiftk\ne = swiftk.load(sys.argv[1], persist=False)\n"


def exit_and_input_cases(model: Path) -> list:
    """A script that exits with work still running; Ctrl-C while the model loads; a prompt too big to tokenize."""
    C = []
    for nm, body in {"open-stream": "it = e.stream('Once upon a time', max_new_tokens=3000)\nprint(next(it))",
                     "open-stream-daemon-consumer": "it = e.stream('Once upon a time', max_new_tokens=3000)\n"
                     "threading.Thread(target=lambda: [None for _ in it], daemon=True).start()",
                     "daemon-generate": "threading.Thread(target=e.generate, args=('Once upon a time',), "
                     "kwargs={'max_new_tokens': 3000}, daemon=True).start()",
                     "daemon-generate_many": "threading.Thread(target=e.generate_many, args=(['a', 'b'],), "
                     "kwargs={'max_new_tokens': 3000}, daemon=True).start()"}.items():
        C.append(Case("9 exit", f"exit:{nm}", f"python -c 'import swiftk; e = swiftk.load(M); {body.splitlines()[0]}'",
                      code=EXIT_SCRIPT.format(body=EXIT_PRELUDE + body), shared=False, timeout=600))
    g = ["generate", "Once upon a time", "-m", str(model), "-n", "3000"]
    for t in (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.25, 3.5, 3.75, 4.0, 4.5, 5.0):
        C.append(Case("9 exit", f"sigint-at-{t}s", f"swiftk {' '.join(g)}  # Ctrl-C after {t} s", kind="cli",
                      argv=g, signal_after=(signal.SIGINT, t), timeout=300))
    for nm, size in {"50MB": 50_000_000, "5MB": 5_000_000}.items():
        C.append(Case("9 exit", f"stdin:{nm}-of-NUL", f"head -c {size} /dev/zero | swiftk generate -n 4 -m M",
                      kind="cli", argv=["generate", "-n", "4", "-m", str(model)], stdin="\0" * size, timeout=60))
    C.append(Case("9 exit", "stdin:chat-5MB", "yes hello | head -c 5000000 | swiftk generate --chat -n 4 -m M",
                  kind="cli", argv=["generate", "--chat", "-n", "4", "-m", str(model)], stdin="hello\n" * 800_000,
                  timeout=60))
    return C


def cli_cases(model: Path, fx: dict, homes_root: Path) -> list:
    C = []
    M = str(model)
    bad_utf8 = homes_root / "bad-utf8.txt"
    bad_utf8.write_bytes(b"hello \xff\xfe world\n")
    empty = homes_root / "empty.txt"
    empty.write_text("")
    badjsonl = homes_root / "bad.jsonl"
    badjsonl.write_text('{"prompt": 5}\n{"prompt": \n')
    blank = homes_root / "blank.txt"
    blank.write_text("\n\n   \n")
    good = homes_root / "good-prompts.txt"
    good.write_text("def add(a, b):\n")
    nanss = homes_root / "nan-skipset.json"
    nanss.write_text('{"attention": NaN, "mlp": []}')

    def add(name, argv, **kw):
        C.append(Case("5 CLI", name, "swiftk " + " ".join(repr(a) if " " in a or not a else a for a in argv),
                      kind="cli", argv=argv, **kw))

    g = ["generate", PROMPT, "-m", M]
    add("no-args", [])
    add("bogus-subcommand", ["frobnicate"])
    for nm, extra in {"n=-1": ["-n", "-1"], "n=0": ["-n", "0"], "n=abc": ["-n", "abc"], "n=huge": ["-n", str(10**12)],
                      "t=nan": ["-t", "nan"], "t=-1": ["-t", "-1"], "t=inf": ["-t", "inf"], "top-k=-5": ["--top-k", "-5"],
                      "top-p=2": ["--top-p", "2"], "top-p=nan": ["--top-p", "nan"], "seed=-1": ["--seed", "-1"],
                      "seed=huge": ["--seed", str(2**70)], "method=bogus": ["--method", "bogus"],
                      "dtype=int4": ["--dtype", "int4"], "device=cuda": ["--device", "cuda"], "device=junk": ["--device", "junk"],
                      "swift=noeq": ["--swift", "max_draft"], "swift=unknown": ["--swift", "bogus=1"],
                      "swift=bad-value": ["--swift", "max_draft=0"], "swift=nan": ["--swift", "eps=NaN"],
                      "swift=opt-option": ["--swift", "skip_ratio=0.3"], "swift=json-obj": ["--swift", "max_draft={}"],
                      "exit-layer-no-method": ["--exit-layer", "3"], "early-exit-no-layer": ["--method", "early_exit"],
                      "early-exit-99": ["--method", "early_exit", "--exit-layer", "99"],
                      "static-no-skipset": ["--method", "static"], "skipset-missing": ["--skip-set", "/nonexistent.json"],
                      "skipset-nan": ["--skip-set", str(nanss)], "skipset-dir": ["--skip-set", "/tmp"],
                      "ngram+skipset": ["--method", "ngram", "--skip-set", str(nanss)],
                      "autoregressive+skipset": ["--method", "autoregressive", "--skip-set", str(nanss)],
                      "save-skipset-dir": ["--save-skip-set", "/"], "save-skipset-missing-dir": ["--save-skip-set", "/nonexistent/x.json"],
                      "drafter-without-moa": ["--drafter", "x.pt"], "moa-drafter-missing": ["--method", "moa", "--drafter", "/nonexistent.pt"],
                      "chat": ["--chat", "-n", "4"], "stop-empty": ["--stop", "", "-n", "4"]}.items():
        add(f"generate:{nm}", g + extra, timeout=90)
    add("generate:ok-json", g + ["-n", str(NTOK), "--json"], check=ar_check)
    add("generate:ok-json-autoregressive", g + ["-n", str(NTOK), "--json", "--method", "autoregressive"], check=ar_check)
    add("generate:ok-json-ngram", g + ["-n", str(NTOK), "--json", "--method", "ngram"], check=ar_check)
    add("generate:model-missing", ["generate", "x", "-m", "/nonexistent.gguf"])
    add("generate:model-dir-empty", ["generate", "x", "-m", str(fx["emptydir"])])
    add("generate:model-trunc", ["generate", "x", "-m", str(fx["trunc-1000.gguf"])])
    add("generate:model-unknown-name", ["generate", "x", "-m", "gpt-5"])
    add("generate:stdin-empty", ["generate", "-m", M], stdin="")
    add("generate:stdin-bad-utf8", ["generate", "-m", M, "-n", "4"], stdin="\udcff")
    add("generate:prompt-empty", ["generate", "", "-m", M])
    # sampled at a high temperature: greedy text may hit EOS and exit before the signal arrives
    add("generate:SIGINT", g + ["-n", "4000", "-t", "1.5", "--seed", "1"], signal_after=(signal.SIGINT, 10), timeout=90,
        check=lambda o, e: ("silently wrong", "exit 0 after SIGINT"))
    # sampled at a high temperature: greedy text may hit EOS and exit before the signal arrives
    add("generate:SIGTERM", g + ["-n", "2000", "-t", "1.5", "--seed", "1"], signal_after=(signal.SIGTERM, 14), timeout=90,
        check=lambda o, e: ("silently wrong", "exit 0 after SIGTERM"))
    add("generate:stdout-closed-pipe", ["generate", PROMPT, "-m", M, "-n", "64"], timeout=90)   # replaced below
    o = ["optimize", "-m", M, "--iterations", "2", "--init", "1", "-n", "4"]
    for nm, extra in {"bad-utf8": ["--prompts", str(bad_utf8), "--out", "o.json"],
                      "empty": ["--prompts", str(empty), "--out", "o.json"],
                      "blank-lines": ["--prompts", str(blank), "--out", "o.json"],
                      "bad-jsonl": ["--prompts", str(badjsonl), "--out", "o.json"],
                      "missing": ["--prompts", "/nonexistent.txt", "--out", "o.json"],
                      "dir": ["--prompts", "/tmp", "--out", "o.json"],
                      "out-dir": ["--prompts", str(good), "--out", "/"],
                      "out-missing-dir": ["--prompts", str(good), "--out", "/nonexistent/o.json"],
                      "iterations-0": ["--prompts", str(good), "--out", "o.json", "--iterations", "0"],
                      "iterations-neg": ["--prompts", str(good), "--out", "o.json", "--iterations", "-3"],
                      "init-neg": ["--prompts", str(good), "--out", "o.json", "--init", "-1"],
                      "state-garbage": ["--prompts", str(badjsonl), "--out", "o.json", "--state", str(nanss)],
                      "no-prompts-flag": ["--out", "o.json"]}.items():
        add(f"optimize:{nm}", o + extra, timeout=120)
    t = ["train-drafter", "-m", M]
    for nm, extra in {"steps-0": ["--steps", "0"], "tokens-neg": ["--tokens", "-5"], "lr-nan": ["--lr", "nan", "--steps", "1", "--tokens", "200"],
                      "lr-neg": ["--lr", "-1", "--steps", "1", "--tokens", "200"], "tli-neg": ["--tli", "-1", "--steps", "1", "--tokens", "200"],
                      "tli-huge": ["--tli", "99", "--steps", "1", "--tokens", "200"], "data-missing": ["--data", "/nonexistent.txt", "--steps", "1", "--tokens", "200"],
                      "data-bad-utf8": ["--data", str(bad_utf8), "--steps", "1", "--tokens", "200"],
                      "out-dir": ["--out", "/", "--steps", "1"], "batch-0": ["--batch", "0"],
                      "resume-nothing": ["--resume", "--steps", "1", "--tokens", "200", "--out", "d.pt"]}.items():
        add(f"train-drafter:{nm}", t + extra, timeout=150)
    for nm, argv in {"unknown": ["pull", "llama-9000"], "verify": ["pull", "--verify"], "force-bogus": ["pull", "--force", "x"]}.items():
        add(f"pull:{nm}", argv, timeout=120)
    for nm, argv in {"ok": ["info", "-m", M], "bad-model": ["info", "-m", "/nonexistent"], "weights-bad": ["info", "-m", M, "--weights", "fp4"],
                     "tiny-gguf": ["info", "-m", str(fx["good.gguf"])], "trunc-gguf": ["info", "-m", str(fx["trunc-40.gguf"])]}.items():
        add(f"info:{nm}", argv)
    for nm, extra in {"port-neg": ["--port", "-1"], "port-huge": ["--port", "70000"], "port-str": ["--port", "x"],
                      "queue-0": ["--queue-size", "0"], "queue-neg": ["--queue-size", "-1"], "swift-bad": ["--swift", "max_draft=0"],
                      "host-bogus": ["--host", "999.1.1.1"], "max-context-0": ["--max-context", "0"],
                      "max-context-huge": ["--max-context", str(10**9)], "model-missing": ["-m", "/nonexistent.gguf"]}.items():
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = str(sk.getsockname()[1])
        port_args = [] if "port" in nm else ["--port", port]   # each its own port: a case that starts serving
        argv = ["serve", "-m", M, *port_args, *extra] if nm != "model-missing" else ["serve", *port_args, *extra]
        add(f"serve:{nm}", argv, timeout=45, check=lambda o, e: ("silently wrong", "serve exited 0"))
    C = [c for c in C if c.name != "generate:stdout-closed-pipe"]
    return C


# ------------------------------------------------------------------------------------------------ server
def server_cases(model: Path, homes: Homes) -> list:
    """One `swiftk serve`, many hostile requests; after each, a normal request must still give the greedy output."""
    results = []
    home = homes.new()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = env_for(home, SWIFTK_PERSIST="0")
    argv = [SWIFTK_BIN, "serve", "--model", str(model), "--served-model-name", "m", "--port",
            str(port), "--log-level", "warning", "--api-key", "K1", "--queue-size", "2"]
    errf = open(home / "serve.err", "w+")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=errf, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            errf.seek(0)
            return [Case("6 server", "startup", "swiftk serve", kind="server")] and [_mk("startup", "raw traceback", errf.read()[-300:])]
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            break
        except OSError:
            if time.monotonic() - t0 > 240:
                kill_group(proc.pid)
                return [_mk("startup", "hang", "server not up in 240 s")]
            time.sleep(0.3)
    H = {"Authorization": "Bearer K1", "Content-Type": "application/json"}

    def post(path, body, headers=None, timeout=60):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, headers=headers if headers is not None else H, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, raw
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    base = {"model": "m", "prompt": PROMPT, "max_tokens": NTOK, "temperature": 0}
    ref_text = AR_TEXT.get("text")

    def normal_ok():
        try:
            st, raw = post("/v1/completions", base, timeout=120)
            txt = json.loads(raw)["choices"][0]["text"]
            return None if st == 200 and txt == ref_text else f"normal request after: {st} {txt[:60]!r}"
        except Exception as e:
            return f"normal request after failed: {type(e).__name__}: {e}"

    def classify(st, raw, expect_text=None):
        try:
            d = json.loads(raw) if raw else None
        except ValueError:
            d = None
        if st in (400, 401, 404, 405, 413, 422, 429) and isinstance(d, dict) and "error" in d:
            return "clear error", f"{st}: {str(d['error'].get('message'))[:200]}"
        if st == 200:
            if expect_text is None:
                return "correct", "200"
            try:
                txt = d["choices"][0].get("text", d["choices"][0].get("message", {}).get("content"))
            except Exception:
                return "silently wrong", f"200 with odd body {raw[:150]!r}"
            return ("correct", "200, greedy output") if txt == expect_text else ("silently wrong", f"200 but {txt[:80]!r} != greedy")
        return "raw traceback", f"{st}: {raw[:200]!r}"

    def case(name, fn, repro):
        t = time.monotonic()
        errf.flush()
        pos = os.path.getsize(errf.name)
        try:
            cls, detail = fn()
        except (TimeoutError, socket.timeout) as e:
            cls, detail = "hang", f"{type(e).__name__}: {e}"
        except Exception as e:
            cls, detail = "raw traceback", f"client side {type(e).__name__}: {e}"
        if proc.poll() is not None:
            cls, detail = ("crash" if proc.returncode < 0 else "raw traceback"), f"server exited {proc.returncode}; {detail}"
        elif cls in OK:
            bad = normal_ok()
            if bad:
                cls, detail = "silently wrong", f"{detail}; {bad}"
        time.sleep(0.2)
        with open(errf.name, errors="replace") as fh:
            fh.seek(pos)
            new = fh.read()
        if "Traceback (most recent call last)" in new and cls in OK:
            last = [l for l in new.strip().splitlines() if l.strip()][-1]
            cls, detail = "raw traceback", f"{detail}; the server logged a traceback: {last[:200]}"
        c = _mk(name, cls, detail, repro)
        c.seconds = round(time.monotonic() - t, 1)
        results.append(c)

    def req(body, headers=None, expect=None, path="/v1/completions"):
        return lambda: classify(*post(path, body, headers), expect)

    R = f"swiftk serve -m {model} --api-key K1; curl -H 'Authorization: Bearer K1' localhost:P/v1/completions -d "
    case("greedy", req(base, expect=ref_text), R + json.dumps(base))
    hostile = {
        "no-auth": (base, {"Content-Type": "application/json"}), "bad-key": (base, {**H, "Authorization": "Bearer nope"}),
        "auth-basic": (base, {**H, "Authorization": "Basic SzE6"}), "auth-empty-bearer": (base, {**H, "Authorization": "Bearer "}),
        "body-not-json": (b"{not json", None), "body-empty": (b"", None), "body-list": ([], None), "body-null": (b"null", None),
        "body-bad-utf8": (b'{"model": "m", "prompt": "\xff"}', None), "body-deep": (b"[" * 100000 + b"]" * 100000, None),
        "body-huge": (json.dumps({**base, "prompt": "x " * 3_000_000}).encode(), None),
        "content-type-text": (base, {**H, "Content-Type": "text/plain"}),
        "missing-prompt": ({"model": "m"}, None), "missing-model": ({"prompt": "x"}, None), "wrong-model": ({**base, "model": "gpt-4"}, None),
        "prompt-int": ({**base, "prompt": 5}, None), "prompt-null": ({**base, "prompt": None}, None), "prompt-empty": ({**base, "prompt": ""}, None),
        "prompt-ids-neg": ({**base, "prompt": [-1]}, None), "prompt-ids-huge": ({**base, "prompt": [10**12]}, None),
        "prompt-ids-bool": ({**base, "prompt": [True]}, None), "prompt-list-2": ({**base, "prompt": ["a", "b"]}, None),
        "prompt-nested-empty": ({**base, "prompt": [[]]}, None), "prompt-surrogate-escape": (b'{"model":"m","prompt":"\\udc80x","max_tokens":4}', None),
        "max_tokens-huge": ({**base, "max_tokens": 10**12}, None), "max_tokens-neg": ({**base, "max_tokens": -1}, None),
        "max_tokens-0": ({**base, "max_tokens": 0}, None), "max_tokens-float": ({**base, "max_tokens": 4.0}, None),
        "max_tokens-str": ({**base, "max_tokens": "4"}, None), "max_tokens-2^63": ({**base, "max_tokens": 2**63}, None),
        "temperature-nan": (json.dumps(base).replace('"temperature": 0', '"temperature": NaN').encode(), None),
        "temperature-inf": (json.dumps(base).replace('"temperature": 0', '"temperature": Infinity').encode(), None),
        "temperature-neg": ({**base, "temperature": -1}, None), "temperature-str": ({**base, "temperature": "hot"}, None),
        "temperature-huge": ({**base, "temperature": 1e308, "seed": 1}, None),
        "top_p-2": ({**base, "top_p": 2}, None), "top_k-neg": ({**base, "top_k": -3}, None),
        "seed-huge": ({**base, "seed": 2**80}, None), "seed-neg": ({**base, "seed": -1, "temperature": 1}, None),
        "n=2": ({**base, "n": 2}, None), "best_of=3": ({**base, "best_of": 3}, None), "logprobs=1": ({**base, "logprobs": 1}, None),
        "echo": ({**base, "echo": True}, None), "suffix": ({**base, "suffix": "x"}, None),
        "presence_penalty": ({**base, "presence_penalty": 1.0}, None), "logit_bias": ({**base, "logit_bias": {"5": 100}}, None),
        "unknown-field": ({**base, "frobnicate": 1}, None), "stop-int": ({**base, "stop": 5}, None),
        "stop-list-int": ({**base, "stop": [5]}, None), "stop-empty-str": ({**base, "stop": ""}, None),
        "stop-many": ({**base, "stop": [f"z{i}" for i in range(5000)]}, None),
        "stream-str": ({**base, "stream": "yes"}, None), "stream_options-no-stream": ({**base, "stream_options": {"include_usage": True}}, None),
        "user-int": ({**base, "user": 5}, None),
    }
    for nm, (body, hdr) in hostile.items():
        show = body if isinstance(body, (dict, list)) else body[:80].decode(errors="replace")
        case(f"completions:{nm}", req(body, hdr), R + repr(show)[:160])
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for nm, body in {"ok": chat, "messages-empty": {**chat, "messages": []}, "messages-str": {**chat, "messages": "hi"},
                     "role-bad": {**chat, "messages": [{"role": "tool", "content": "x"}]},
                     "content-null": {**chat, "messages": [{"role": "user", "content": None}]},
                     "content-parts-image": {**chat, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                     "tools": {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]},
                     "max_completion_tokens-both": {**chat, "max_completion_tokens": 4},
                     "response_format": {**chat, "response_format": {"type": "json_object"}},
                     # tool calls: SmolLM2's template shows no tools, so any tool_choice but none is a 400
                     "tools-required": {**chat, "tools": [TOOL], "tool_choice": "required"},
                     "tools-none": {**chat, "tools": [TOOL], "tool_choice": "none"},
                     "tool_choice-dict-empty": {**chat, "tools": [TOOL], "tool_choice": {}},
                     "tool_choice-no-tools": {**chat, "tool_choice": {"type": "function", "function": {"name": "f"}}},
                     "tools-item-str": {**chat, "tools": ["f"]},
                     "tools-name-10k": {**chat, "tools": [{"type": "function", "function": {"name": "f" * 10000}}]},
                     "tools-params-array": {**chat, "tools": [{"type": "function", "function": {
                         "name": "f", "parameters": {"type": "array"}}}], "tool_choice": "none"},
                     "tools-1000": {**chat, "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                                      for i in range(1000)], "tool_choice": "none"},
                     "tool-msg-no-id": {**chat, "messages": [{"role": "tool", "content": "x"}]},
                     "tool-msg": {**chat, "messages": [{"role": "user", "content": "hi"}, {
                         "role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                               "function": {"name": "f",
                                                                                            "arguments": "{"}}]},
                         {"role": "tool", "tool_call_id": "c", "content": "ok"}]},
                     "tool_calls-args-obj": {**chat, "messages": [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
                     }.items():
        case(f"chat:{nm}", req(body, path="/v1/chat/completions"), R.replace("completions -d", "chat/completions -d") + json.dumps(body)[:160])
    case("get-unknown-route", lambda: classify(*_get(url + "/v1/nope", H)), "curl localhost:P/v1/nope")
    case("get-completions", lambda: classify(*_get(url + "/v1/completions", H)), "curl -X GET localhost:P/v1/completions")
    case("models-noauth", lambda: classify(*_get(url + "/v1/models", {})), "curl localhost:P/v1/models")

    def disconnect(stream):
        def fn():
            body = json.dumps({**base, "max_tokens": 400, "stream": stream}).encode()
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer K1\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(1.0)
            s.close()
            time.sleep(0.5)
            return "correct", "client left mid-request"
        return fn

    case("disconnect:stream", disconnect(True), "curl -N ... stream=true, then Ctrl-C")
    case("disconnect:non-stream", disconnect(False), "curl ... max_tokens=400, then Ctrl-C")

    def half_body():
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer K1\r\nContent-Length: 1000\r\n\r\n{\"mo")
        time.sleep(0.5)
        s.close()
        return "correct", "client sent half a body and left"

    case("disconnect:half-body", half_body, "printf 'POST ... Content-Length: 1000 ...' | nc")

    def flood():   # more than the batch (8 running) and the waiting room (2) together: some get 429, and never
        st, raw = post("/v1/completions", {**base, "max_tokens": 32}, timeout=120)   # more than 10 are admitted;
        solo = json.loads(raw)["choices"][0]["text"] if st == 200 else None           # each 200 is the solo answer
        bursts = []
        for _ in range(4):   # the admission race showed in about 1 burst of 4
            outs = []

            def one():
                outs.append(post("/v1/completions", {**base, "max_tokens": 32}, timeout=120))
            ts = [threading.Thread(target=one) for _ in range(16)]
            [t.start() for t in ts]
            [t.join(150) for t in ts]
            bursts.append(outs)
        codes = [sorted(st for st, _ in outs) for outs in bursts]
        admitted = [c.count(200) for c in codes]
        wrong = sum(st == 200 and json.loads(raw)["choices"][0]["text"] != solo for outs in bursts for st, raw in outs)
        ok = solo is not None and max(admitted) <= 10 and not wrong and \
            all(all(st in (200, 429) for st in c) and 429 in c for c in codes)
        return ("clear error" if ok else "silently wrong"), (f"4 bursts of 16 concurrent requests, batch 8 + queue "
                                                             f"2: {admitted} admitted, {wrong} answers not the solo one")

    case("queue-flood", flood, "16 concurrent completions against --queue-size 2 (a batch of at most 8)")

    def stream_ok():
        body = json.dumps({**base, "stream": True}).encode()
        req_ = urllib.request.Request(url + "/v1/completions", data=body, headers=H, method="POST")
        with urllib.request.urlopen(req_, timeout=60) as r:
            txt = ""
            for line in r.read().decode().splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    txt += json.loads(line[6:])["choices"][0].get("text", "")
        return ("correct", "stream equals greedy") if txt == ref_text else ("silently wrong", f"stream {txt[:60]!r}")

    case("stream:greedy", stream_ok, R + "'{... \"stream\": true}'")
    # SIGTERM while a request is running
    def sigterm():
        errf.flush()
        sig_pos = os.path.getsize(errf.name)
        th = threading.Thread(target=lambda: post("/v1/completions", {**base, "max_tokens": 400}, timeout=60), daemon=True)
        th.start()
        time.sleep(1.5)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            return "hang", "server did not exit 30 s after SIGTERM"
        errf.seek(sig_pos)
        err = errf.read()
        if "Traceback (most recent call last)" in err:
            return "raw traceback", f"exit {proc.returncode}; traceback on stderr: {err.strip().splitlines()[-1][:200]}"
        if group_alive(proc.pid):
            kill_group(proc.pid)
            return "leftover", "child processes left after server exit"
        return "correct", f"exit {proc.returncode} after SIGTERM"

    t = time.monotonic()
    cls, detail = sigterm()
    c = _mk("SIGTERM-mid-request", cls, detail, "kill -TERM <serve pid> during a request")
    c.seconds = round(time.monotonic() - t, 1)
    results.append(c)
    if proc.poll() is None:
        kill_group(proc.pid)
    shutil.rmtree(home, ignore_errors=True)
    return results


def _get(u, headers):
    try:
        with urllib.request.urlopen(urllib.request.Request(u, headers=headers), timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _mk(name, cls, detail, repro="swiftk serve ..."):
    c = Case("6 server", name, repro, kind="server")
    c.cls, c.detail = cls, detail
    return c


# ------------------------------------------------------------------------------------------------ main
def main():
    # started in the background (`nohup ... &`), this process ignores SIGINT and so would every case: Python keeps
    # an inherited SIG_IGN, and the SIGINT cases would read that as swiftk ignoring Ctrl-C. A handler here is
    # reset to the default in each child at exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated group numbers (1-9)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="/tmp/hostile_sweep")
    ap.add_argument("--filter", default="", help="substring of case names to keep")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else set("123456789")
    t_start = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="hostile-sweep-"))
    print(f"work dir {root}", file=sys.stderr)
    r = subprocess.run([PY, "-c", "from swiftk.loading.registry import pull; print(pull('smollm2-135m', progress=False))"],
                       capture_output=True, text=True, cwd=REPO)
    model = Path(r.stdout.strip().splitlines()[-1]).resolve()
    homes = Homes(root, model)
    homes.make_template()
    # the reference: greedy autoregressive, once
    ref = subprocess.run([PY, "-c", f"import json, torch; torch.set_num_threads(1); import swiftk; e = swiftk.load({str(model)!r}, persist=False); "
                          f"o = e.generate({PROMPT!r}, max_new_tokens={NTOK}, method='autoregressive'); "
                          f"print(json.dumps({{'ids': o.token_ids, 'text': o.text}}))"],
                         env=env_for(homes.template), capture_output=True, text=True, cwd=REPO)
    AR_TEXT.update(json.loads(ref.stdout.strip().splitlines()[-1]))
    print(f"reference ({time.monotonic() - t_start:.0f} s): {AR_TEXT['text']!r}", file=sys.stderr)
    fxdir = root / "fixtures"
    fxdir.mkdir()
    fx = make_fixtures(fxdir)
    side = hf_side_variants(fxdir, fx["goodhf"])
    cases = []
    if "1" in only:
        cases += file_cases(fx)
    if "2" in only:
        cases += side_cases(side)
    if "3" in only:
        cases += home_cases(model, homes)
    if "4" in only:
        cases += api_cases()
    if "5" in only:
        cases += cli_cases(model, fx, root)
    if "7" in only:
        cases += batch_cases()
    if "8" in only:
        cases += kernel_manifest_cases()
    if "9" in only:
        cases += exit_and_input_cases(model)
    if a.filter:
        cases = [c for c in cases if a.filter in c.name]
    print(f"{len(cases)} cases (+ server)", file=sys.stderr)
    # work units: shared API cases in chunks on one engine each; the rest one subprocess each
    shared = [c for c in cases if c.kind == "py" and c.shared]
    units = [("py", shared[i::a.jobs]) for i in range(a.jobs) if shared[i::a.jobs]]
    units += [("py", [c]) for c in cases if c.kind == "py" and not c.shared]
    units += [("cli", [c]) for c in cases if c.kind == "cli"]
    lock = threading.Lock()
    queue = list(units)
    n_done = [0]

    def worker(k):
        wd = root / f"w{k}"
        wd.mkdir()
        while True:
            with lock:
                if not queue:
                    return
                kind, cs = queue.pop(0)
            try:
                if kind == "py":
                    run_py_batch(cs, homes, model, wd)
                else:
                    run_cli(cs[0], homes, wd)
            except Exception as e:   # a bug of this script, not of swiftk: say so, keep going
                for c in cs:
                    if c.cls is None:
                        c.cls, c.detail = "raw traceback", f"HARNESS ERROR (not swiftk): {type(e).__name__}: {e}"
            with lock:
                n_done[0] += len(cs)
                for c in cs:
                    if c.cls not in OK:
                        print(f"  [{c.cls}] {c.name}: {c.detail[:160]}", file=sys.stderr)
                print(f"  {n_done[0]}/{len(cases)} done ({time.monotonic() - t_start:.0f} s)", file=sys.stderr)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(a.jobs)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if "6" in only:
        srv = server_cases(model, homes)
        cases += [c for c in srv if not a.filter or a.filter in c.name]
    report(cases, a.out, time.monotonic() - t_start)
    shutil.rmtree(root, ignore_errors=True)


def report(cases, out, wall):
    groups = sorted({c.group for c in cases})
    lines = [f"# swiftk hostile sweep: {len(cases)} cases, {wall:.0f} s", "",
             "| group | " + " | ".join(CLASSES) + " | total |", "|---" * (len(CLASSES) + 2) + "|"]
    for g in groups + ["all"]:
        cs = [c for c in cases if g == "all" or c.group == g]
        counts = [sum(c.cls == k for c in cs) for k in CLASSES]
        lines.append(f"| {g} | " + " | ".join(str(n) for n in counts) + f" | {len(cs)} |")
    lines += ["", "## cases not in {clear error, correct}", "", "| class | group | case | detail | reproduction |",
              "|---|---|---|---|---|"]
    for c in sorted(cases, key=lambda c: (CLASSES.index(c.cls) if c.cls in CLASSES else 99, c.group, c.name)):
        if c.cls not in OK:
            lines.append(f"| {c.cls} | {c.group} | `{c.name}` | {c.detail.replace('|', '/').replace(chr(10), ' ')[:300]} | "
                         f"`{c.repro.replace('|', '/')[:300]}`; rerun: `tools/hostile_sweep.py --only {c.group[0]} "
                         f"--filter '{c.name}'` |")
    text = "\n".join(lines)
    print(text)
    Path(out + ".md").write_text(text + "\n\n## all cases\n\n" + "\n".join(
        f"- [{c.cls}] {c.group} `{c.name}` ({c.seconds} s): {c.detail}" for c in cases) + "\n")
    Path(out + ".json").write_text(json.dumps([{"group": c.group, "name": c.name, "class": c.cls, "detail": c.detail,
                                                 "repro": c.repro, "seconds": c.seconds} for c in cases], indent=1))
    print(f"\nfull list: {out}.md, {out}.json", file=sys.stderr)


if __name__ == "__main__":
    main()
