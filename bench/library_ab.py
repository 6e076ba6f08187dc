"""Two builds of the whole CPU kernel library side by side: pass costs and greedy tokens per model.

    python -m bench.library_ab --a-opt=-O3 --b-opt=-O2 --models smollm2-135m,qwen2.5-coder-1.5b --reps 5
    python -m bench.library_ab --a-checkout /tmp/old --models smollm2-135m   # another checkout, as installed there

Each arm is kernels/cpu (of a git revision, or the worktree) built by CMake as ``pip install`` builds it (the
``native`` variant; ``SWIFTK_CPU_OPT`` = the arm's flags, after the variant's: an ``-march`` there wins) into an
install folder with its manifest, and timed by a child process that loads it in place of the installed one. Per model and repetition, one child per arm, the arms
alternated: it loads the model (int8 activations on GGUF blocks, the default, or ``--activations float32``), puts ``--ctx`` tokens in the cache,
then times a decode step and verify passes of ``--verify`` tokens (each the median of ``--inner`` passes, the
sizes interleaved), with ``--prefill N`` an N-token prefill from an empty cache (median of 3, tokens/s), and decodes
32 greedy tokens. Prints per model the median over repetitions of each arm's step
time and of each pass in steps, B / A, the read bandwidth measured beside them, each arm's compile time, and
whether the arms' greedy tokens agree. ``--a-checkout DIR``: arm A is another checkout of swiftk as installed in its
own ``DIR/.venv`` (its Python code and its installed library together: a revision whose library and Python
disagree with this worktree's, such as one with another C ABI, is compared this way). Writes ``library_ab_<date>.json`` / ``.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(r"""
    import json, statistics, sys, time
    from pathlib import Path
    import torch
    from swiftk.runtime.ops import native
    if sys.argv[1] != "-":
        native.INSTALLED = Path(sys.argv[1])
    import swiftk
    model, ctx, inner = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    sizes = [int(t) for t in sys.argv[5].split(",")]
    act = sys.argv[6] if len(sys.argv) > 6 else "int8"
    pp = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    lib = native.library()
    if hasattr(lib, "swk_set_q_linear"):   # a revision before the layer loop called the block matmul itself
        import ctypes
        lib.swk_set_q_linear.argtypes = [ctypes.c_void_p]
        lib.swk_set_q_linear(ctypes.cast(lib.swk_q_linear_ld, ctypes.c_void_p))
    eng = swiftk.load(model, persist=False, activations=act)
    assert native.source().startswith("installed ("), native.source()
    m, cache = eng.model, eng.cache
    with torch.inference_mode():
        m.forward(torch.arange(ctx) % 1000 + 100, torch.arange(ctx), torch.arange(ctx), cache)
        cache.reset()
        cache.advance(ctx)
        times = {T: [] for T in [1, *sizes]}
        for r in range(inner + 1):
            for T in times:
                ids, pos = torch.full((T,), 5), torch.arange(ctx, ctx + T)
                t0 = time.perf_counter()
                m.forward(ids, pos, pos, cache)
                if r:   # the first round warms up
                    times[T].append(time.perf_counter() - t0)
        med = {T: statistics.median(v) for T, v in times.items()}
        out = {"step_ms": med[1] * 1e3, **{f"verify{T}": med[T] / med[1] for T in sizes}}
        if pp:   # llama-bench's pp, as bench.versus_native times it; the first run warms up
            from bench.versus_native import swiftk_pp
            out[f"pp{pp}_tok_s"] = statistics.median([swiftk_pp(eng, pp) for _ in range(4)][1:])
    toks = eng.generate("def quicksort(arr):", max_new_tokens=32, method="autoregressive").token_ids
    json.dump({**out, "tokens": toks}, sys.stdout)
""")


def build(rev: str, opt: str, root: Path) -> tuple:
    """(install folder, compile seconds) of kernels/cpu at ``rev`` ("WORKTREE": the files on disk) built with ``opt``."""
    from swiftk.runtime.ops import kernel_id, native, native_build

    src = root / "src"
    if rev == "WORKTREE":
        src = ROOT / "kernels" / "cpu"
    else:
        src.mkdir(parents=True)
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:kernels/cpu"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.split()
        for n in names:
            (src / n).write_bytes(subprocess.run(["git", "show", f"{rev}:kernels/cpu/{n}"], cwd=ROOT, check=True,
                                                 capture_output=True).stdout)
    out, tmp = root / "_native", root / "build"
    t0 = time.perf_counter()
    subprocess.run(["cmake", "-S", str(src), "-B", str(tmp), "-DCMAKE_BUILD_TYPE=Release", "-DSWIFTK_CPU_VARIANTS=native",
                    f"-DSWIFTK_CPU_OPT={opt}", f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}"], check=True,
                   capture_output=True)
    subprocess.run(["cmake", "--build", str(tmp), "-j", str(os.cpu_count() or 2)], check=True, capture_output=True)
    secs = time.perf_counter() - t0
    lib = out / "swiftk_cpu-native.so"
    # the manifest names the worktree's sources: the loader accepts the library whatever revision it came from
    (out / "manifest.json").write_text(json.dumps({
        "sources": native.sources_digest(), "cpu": kernel_id.cpu_id(),
        "variants": {"native": {"file": lib.name, **native_build.digest(lib)}}}))
    return out, secs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a-rev", default="WORKTREE")
    ap.add_argument("--b-rev", default="WORKTREE")
    ap.add_argument("--a-opt", default="-O3")
    ap.add_argument("--a-checkout", default="", help="arm A: this checkout as installed in its own .venv")
    ap.add_argument("--b-opt", default="-O3")
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--reps", type=int, default=5, help="child processes per arm and model (odd: a true median)")
    ap.add_argument("--inner", type=int, default=9, help="timed passes of each size inside a child")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--verify", default="2,4,8,16")
    ap.add_argument("--activations", default="int8", choices=("int8", "float32"),
                    help="the block matmul's activations: int8 (cpu_qdot, the default) or float32 (cpu_quant)")
    ap.add_argument("--prefill", type=int, default=0, help="also time a prefill of this many tokens (tokens/s)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    if args.reps % 2 == 0:
        ap.error("--reps must be odd (the median of an even count is not one of the runs)")
    from benchlib.machine import cpu_arch
    from benchlib.machine import read_bandwidth

    arms = {"A": (args.a_rev, args.a_opt), "B": (args.b_rev, args.b_opt)}
    work = Path(tempfile.mkdtemp(prefix="library_ab-"))
    folders, compile_s = {}, {}
    if args.a_checkout:
        arms["A"] = (f"checkout {args.a_checkout}", "as installed")
    for name, (rev, opt) in arms.items():
        if name == "A" and args.a_checkout:
            folders[name], compile_s[name] = "-", float("nan")
            continue
        folders[name], compile_s[name] = build(rev, opt, work / name)
        print(f"arm {name}: {rev} {opt}: compiled in {compile_s[name]:.0f} s", flush=True)
    sizes = args.verify
    res = {"cpu_arch": cpu_arch(), "threads": os.cpu_count(), "arms": {k: {"rev": r, "opt": o, "compile_s": compile_s[k]}
                                                                   for k, (r, o) in arms.items()},
           "reps": args.reps, "inner": args.inner, "ctx": args.ctx, "activations": args.activations,
           "models": {}}
    lines = [f"# Kernel library A/B, {_dt.datetime.now():%Y-%m-%d %H:%M}", "",
             f"CPU: {res['cpu_arch']}, {os.cpu_count()} threads. " +
             "; ".join(f"{k}: {r} {o} (compiled in {compile_s[k]:.0f} s)" for k, (r, o) in arms.items()) +
             f". {args.reps} child processes per arm and model, alternated; each: median of {args.inner} passes per "
             f"size at a {args.ctx}-token context, {args.activations} activations. Medians over the children.", ""]
    for model in args.models.split(","):
        runs = {k: [] for k in arms}
        bw = []
        for r in range(args.reps):
            for k in (arms if r % 2 == 0 else reversed(list(arms))):
                other = k == "A" and args.a_checkout
                py = str(Path(args.a_checkout) / ".venv" / "bin" / "python") if other else sys.executable
                p = subprocess.run([py, "-c", CHILD, str(folders[k]), model, str(args.ctx), str(args.inner),
                                    sizes, args.activations, str(args.prefill)], capture_output=True, text=True,
                                   cwd=args.a_checkout if other else ROOT, env={**os.environ, "SWIFTK_PERSIST": "0"})
                if p.returncode:
                    sys.exit(f"arm {k} on {model} failed:\n{p.stderr[-3000:]}")
                runs[k].append(json.loads(p.stdout.strip().splitlines()[-1]))
            bw.append(read_bandwidth())
        keys = ["step_ms"] + [f"verify{T}" for T in sizes.split(",")]
        keys += [f"pp{args.prefill}_tok_s"] if args.prefill else []
        med = {k: {q: statistics.median(x[q] for x in runs[k]) for q in keys} for k in arms}
        same = all(x["tokens"] == runs["A"][0]["tokens"] for k in arms for x in runs[k])
        res["models"][model] = {"runs": runs, "median": med, "read_gb_s": bw, "tokens_equal": same}
        lines += [f"## {model}", "", f"read bandwidth {min(bw):.0f}-{max(bw):.0f} GB/s; greedy tokens of every run "
                  f"{'equal' if same else 'DIFFER'}", "", "| | " + " | ".join(keys) + " |",
                  "|---|" + "---:|" * len(keys)]
        for k in arms:
            lines.append(f"| {k} | " + " | ".join(f"{med[k][q]:.3f}" for q in keys) + " |")
        lines.append("| B / A | " + " | ".join(f"{med['B'][q] / med['A'][q]:.3f}" for q in keys) + " |")
        lines.append("")
        print("\n".join(lines[-(len(arms) + 6):]), flush=True)
    stamp = f"{_dt.datetime.now():%Y%m%d-%H%M%S}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"library_ab_{stamp}.json").write_text(json.dumps(res, indent=1))
    (out / f"library_ab_{stamp}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}/library_ab_{stamp}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
