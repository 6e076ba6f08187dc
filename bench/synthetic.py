"""A 7B-shaped Q4_K_M GGUF with random weights: can swiftk load a model of that size on a 24 GiB machine, in how
much memory, and how fast does it decode next to llama.cpp on the same file? (Memory and speed only: the weights
are noise.)

    python -m bench.synthetic --path /tmp/synthetic-7b-q4_k_m.gguf --tokens 16

The file (~4 GB; written once, never committed) has Llama-2-7B's shapes (32 layers, 4096 wide, 11008 MLP, 32
heads) and llama.cpp's Q4_K_M mix: Q4_K everywhere but Q6_K for attn_v and ffn_down in every other layer and for
the output head; the tokenizer is SmolLM2-135M's (its registry file's metadata, 49152 tokens). Each engine runs in
its own process, so the peak RSS reported (getrusage's ru_maxrss) is its own: load plus a greedy decode of
``--tokens`` tokens from a short prompt. Writes ``synthetic_<date>.json/.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

L, D, I, H, V = 32, 4096, 11008, 32, 49152
F16_AT = {"Q4_K": (0, 2), "Q6_K": (208,)}   # byte offsets of the float16 scales in each block


def _blocks(rng, rows: int, cols: int, name: str) -> np.ndarray:
    """Random blocks of a K-quant whose float16 scales are small finite numbers (weights ~ +-0.05)."""
    import gguf

    t = gguf.GGMLQuantizationType[name]
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    raw = np.frombuffer(rng.bytes(rows * cols // bs * ts), dtype=np.uint8).reshape(rows, cols // bs, ts).copy()
    for off in F16_AT[name]:
        raw[:, :, off:off + 2] = np.array([2e-3 if off == 0 else 1e-3], dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write(path: Path) -> None:
    import gguf

    from swiftk.loading.gguf import read_gguf
    from swiftk.loading.registry import pull

    src = read_gguf(pull("smollm2-135m", progress=False)).metadata
    rng = np.random.default_rng(0)
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_block_count(L)
    w.add_context_length(4096)
    w.add_embedding_length(D)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(H)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model(src["tokenizer.ggml.model"])
    w.add_tokenizer_pre(src.get("tokenizer.ggml.pre", "smollm"))
    w.add_token_list(src["tokenizer.ggml.tokens"])
    w.add_token_types(src["tokenizer.ggml.token_type"])
    w.add_token_merges(src["tokenizer.ggml.merges"])
    w.add_bos_token_id(int(src["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(src["tokenizer.ggml.eos_token_id"]))
    w.add_add_bos_token(False)
    Q = gguf.GGMLQuantizationType

    def put(name, rows, cols, fmt):
        qa = _blocks(rng, rows, cols, fmt)
        w.add_tensor(name, qa, raw_shape=qa.shape, raw_dtype=Q[fmt])

    put("token_embd.weight", V, D, "Q4_K")
    put("output.weight", V, D, "Q6_K")
    w.add_tensor("output_norm.weight", np.ones(D, dtype=np.float32))
    for i in range(L):
        b = f"blk.{i}."
        more = "Q6_K" if i % 2 == 0 else "Q4_K"   # Q4_K_M spends more bits on v and down in half the layers
        for n, rows, cols, fmt in (("attn_q", D, D, "Q4_K"), ("attn_k", D, D, "Q4_K"), ("attn_v", D, D, more),
                                   ("attn_output", D, D, "Q4_K"), ("ffn_gate", I, D, "Q4_K"),
                                   ("ffn_up", I, D, "Q4_K"), ("ffn_down", D, I, more)):
            put(b + n + ".weight", rows, cols, fmt)
        w.add_tensor(b + "attn_norm.weight", np.ones(D, dtype=np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(D, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    tmp.replace(path)


_CHILD = r"""
import json, resource, sys, time
path, engine, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompt = "def fibonacci(n):\n    "
out = {"engine": engine}
t0 = time.perf_counter()
if engine == "llama.cpp":
    from benchlib.llamacpp import llamacpp_run, load_llamacpp
    llm, why = load_llamacpp(path, threads, n_ctx=256)
    if llm is None:
        print(json.dumps({"engine": engine, "error": why})); sys.exit(0)
    out["load_s"] = time.perf_counter() - t0
    ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    llamacpp_run(llm, ids, 2, [])
    r = llamacpp_run(llm, ids, tokens, [])
    out["tok_s"] = r["new_tokens"] / r["wall_time_s"]
else:
    import torch, swiftk
    torch.set_num_threads(threads)
    eng = swiftk.load(path, weights=engine, persist=False, max_context=256)
    out["load_s"] = time.perf_counter() - t0
    out["resident_weight_bytes"] = eng.info()["resident_weight_bytes"]
    eng.generate(prompt, max_new_tokens=2, method="autoregressive")
    r = eng.generate(prompt, max_new_tokens=tokens, method="autoregressive", prefix_cache=False)
    out["tok_s"] = r.stats.tokens_per_s
out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.synthetic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default="/tmp/synthetic-7b-q4_k_m.gguf")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--engines", default="native,llama.cpp")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    from benchlib.machine import set_threads

    threads = set_threads(a.threads)
    path = Path(a.path)
    if not path.is_file():
        print(f"writing {path} ...", flush=True)
        write(path)
    size = path.stat().st_size
    rows = []
    for engine in a.engines.split(","):
        p = subprocess.run([sys.executable, "-c", _CHILD, str(path), engine, str(a.tokens), str(threads)],
                           capture_output=True, text=True)
        line = (p.stdout.strip().splitlines() or [""])[-1]
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            r = {"engine": engine, "error": (p.stderr or p.stdout).strip()[-600:]}
        rows.append(r)
        print(json.dumps(r), flush=True)
    md = [f"# bench.synthetic: 7B-shaped Q4_K_M, {size / 1e9:.2f} GB file, {threads} threads, {a.tokens} tokens",
          "", "| engine | load s | peak RSS GB | RSS / file | resident weights / file | decode tok/s |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['engine']} | error: {r['error'][:120]} | | | | |")
            continue
        res = r.get("resident_weight_bytes")
        md.append(f"| {r['engine']} | {r['load_s']:.1f} | {r['peak_rss_bytes'] / 1e9:.2f} | "
                  f"{r['peak_rss_bytes'] / size:.2f} | {'-' if res is None else f'{res / size:.3f}'} | "
                  f"{r['tok_s']:.2f} |")
    print("\n".join(md))
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from swiftk.atomic import write_atomic

    cmd = "python -m bench.synthetic " + " ".join(argv if argv is not None else sys.argv[1:])
    write_atomic(str(out / f"synthetic_{stamp}.json"), json.dumps({"file_bytes": size, "threads": threads,
                                                                    "tokens": a.tokens, "rows": rows,
                                                                    "command": cmd}, indent=1))
    write_atomic(str(out / f"synthetic_{stamp}.md"), "\n".join(md[:1] + ["", f"`{cmd}`"] + md[1:]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
