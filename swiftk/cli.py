"""``swiftk`` command line: generate, optimize, train-drafter, pull, serve, info, export-hf."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import time
from pathlib import Path

import swiftk
from swiftk import background

from .errors import SwiftkError
from .files import MAX_JSON_BYTES, check_output_path, read_text
from .home import swiftk_home
from .loading.registry import DEFAULT_MODEL, MODELS, model_info, pull
from .options import load_time, split_options


# more than any context holds: 128k tokens of the longest vocabulary entries (~160 bytes) is ~20 M characters
MAX_STDIN_CHARS = 32 << 20


def _common(p):
    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help=f"registry name ({', '.join(MODELS)}), .gguf path or HF dir")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--weights", default=None, choices=["native", "float32", "bfloat16", "int8"],
                   help="CPU weight format: native = the GGUF file's blocks (the default for a quantized file), "
                        "float32/bfloat16/int8 = swiftk's float-activation formats (bfloat16/int8 round the model)")
    p.add_argument("--activations", default=None, choices=["int8", "float32"],
                   help="native weights: int8 (default; integer dot products as llama.cpp) or float32 (the exact "
                        "de-quantized model)")
    p.add_argument("--kv-cache", default=None, choices=["float32", "float16"],
                   help="the KV cache's element type (default: float16 under int8 activations, else the compute dtype)")


def _load(a, **kw):
    """swiftk.load with the options _common parsed."""
    return swiftk.load(a.model, device=a.device, dtype=a.dtype, weights=a.weights, activations=a.activations,
                       kv_cache=a.kv_cache, **kw)


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:   # also while torch imports (~4 s), before a command runs
        print("swiftk: interrupted", file=sys.stderr)
        return 130


def _main(argv) -> int:
    from . import methods   # lazy: imports torch (~4 s), inside main()'s Ctrl-C handler

    ap = argparse.ArgumentParser(prog="swiftk", description="Lossless self-speculative decoding (SWIFT)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    names = list(methods.names())
    for add in (_generate_args, _optimize_args, _train_args, _pull_args, _serve_args, _export_args, _info_args):
        add(sub, names)

    args = ap.parse_args(argv)
    try:
        return {"generate": _generate, "optimize": _optimize, "train-drafter": _train_drafter, "pull": _pull,
                "info": _info, "serve": _serve, "export-hf": _export_hf}[args.cmd](args)
    except SwiftkError as e:
        background.stop_jobs()   # any announcement of it first: the error is the last line
        print(f"swiftk: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("swiftk: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # `swiftk generate ... | head`: the reader left, nothing to report
        _drop_stdout()
        return 141
    except OSError as e:   # the output cannot be written (a full disk, /dev/full) or another OS-level failure
        _drop_stdout()
        background.stop_jobs()
        print(f"swiftk: error: {e}", file=sys.stderr)
        return 1



def _generate_args(sub, names: list) -> None:
    g = sub.add_parser("generate", help="generate text")
    g.add_argument("prompt", nargs="?", help="prompt text (default: read stdin)")
    _common(g)
    g.add_argument("--max-new-tokens", "-n", type=int, default=128)
    g.add_argument("--method", default=None, choices=names,
                   help="default: swift, or draft_model with --draft-model")
    g.add_argument("--draft-model", help="a smaller model with the same tokenizer (registry name or path) drafting "
                   "for the target: method draft_model")
    g.add_argument("--exit-layer", type=int, default=None, help="early_exit: the draft runs layers 0..E-1")
    g.add_argument("--temperature", "-t", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print text and statistics as JSON")
    g.add_argument("--drafter", help="moa: a trained drafter file (default: this model's, see train-drafter)")
    g.add_argument("--skip-set", help="a saved skip set (JSON): swift starts from it without optimizing; static "
                   "decodes with it")
    g.add_argument("--save-skip-set", help="write the skip set found to this JSON file")
    g.add_argument("--swift", action="append", default=[], metavar="KEY=VALUE",
                   help="SWIFT option, e.g. --swift skip_ratio=0.4 --swift max_tree_nodes=16")


def _optimize_args(sub, names: list) -> None:
    o = sub.add_parser("optimize", help="Self-SD: search a static skip set offline (tokens/s on calibration prompts)")
    _common(o)
    o.add_argument("--prompts", required=True, help="calibration prompts: .jsonl (prompt/text/turns) or one per line")
    o.add_argument("--out", required=True, help="skip-set JSON to write (use with --method static --skip-set)")
    o.add_argument("--iterations", type=int, default=30, help="skip sets to evaluate in all (resumed ones count)")
    o.add_argument("--init", type=int, default=8, help="random sets before Bayesian optimization starts")
    o.add_argument("--max-new-tokens", "-n", type=int, default=64)
    o.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    o.add_argument("--state", help="search state file (default OUT.state.json); an existing one is resumed")
    o.add_argument("--seed", type=int, default=0)


def _train_args(sub, names: list) -> None:
    t = sub.add_parser("train-drafter", help="train the MoA drafter of a model on CPU (teacher-forced, resumable)")
    t.add_argument("--model", "-m", default=DEFAULT_MODEL, help=f"registry name ({', '.join(MODELS)}), .gguf path or HF dir")
    t.add_argument("--data", action="append", default=None, metavar="SOURCE",
                   help="'stdlib', 'site-packages' (installed Python sources), 'docs' (prose under /usr/share/doc and "
                   "package descriptions), a .jsonl of prompts {text, chat} (the document is the prompt plus the "
                   "model's greedy answer) or a text file; repeatable (default: stdlib, site-packages, docs)")
    t.add_argument("--tokens", type=int, default=1_000_000, help="corpus size in tokens (5%% held out)")
    t.add_argument("--answer-tokens", type=int, default=128, help="tokens of each generated answer")
    t.add_argument("--out", help="drafter file (default: where generate(method='moa') looks for it)")
    t.add_argument("--chunk", type=int, default=384, help="tokens per training chunk")
    t.add_argument("--reuse", type=int, default=2, help="steps that train on one target pass's features")
    t.add_argument("--tli", type=int, default=0, help="target layers that finish each draft step")
    t.add_argument("--no-lsa", action="store_true", help="ablation: last target layer's K/V instead of LSA")
    t.add_argument("--anchor", action="store_true", help="also read the target's final hidden state at the last "
                   "verified position (EAGLE's feature)")
    t.add_argument("--steps", type=int, default=800)
    t.add_argument("--batch", type=int, default=4, help="chunks per step")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue from OUT.ckpt (same settings)")


def _pull_args(sub, names: list) -> None:
    p = sub.add_parser("pull", help="download a registry model into the cache")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=list(MODELS))
    p.add_argument("--force", action="store_true", help="download and verify again")
    p.add_argument("--verify", action="store_true",
                   help="re-hash a cached copy in full (every load checks only 3 MiB of it); a bad copy is deleted")


def _serve_args(sub, names: list) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the [serve] extra); see docs/serve.md")
    _common(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-context", type=int, default=None, help="tokens of context (default: the model's, capped)")
    s.add_argument("--served-model-name", help="the model id clients send (default: --model's name)")
    s.add_argument("--method", default=None, choices=names,
                   help="default: swift, or draft_model with --draft-model")
    s.add_argument("--draft-model", help="a smaller model with the same tokenizer drafting for the target")
    s.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (repeatable); default: no key needed")
    s.add_argument("--history-scope", default="server", choices=["server", "key"],
                   help="whose earlier outputs draft a response: every client's (server) or the same API key's")
    s.add_argument("--max-batch", type=int, default=None,
                   help="requests decoding together, every round in one pass (default: sized to the machine)")
    s.add_argument("--queue-size", type=int, default=16, help="requests waiting for a slot before HTTP 429")
    s.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file replacing the model's "
                   "(e.g. one that defines tools in the Hermes <tool_call> format)")
    s.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                   help="comma-separated origins a browser may call from (CORS), or '*'; default: none")
    s.add_argument("--swift", action="append", default=[], metavar="KEY=VALUE",
                   help="decode option for every request, or optimizer option for the engine")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _export_args(sub, names: list) -> None:
    x = sub.add_parser("export-hf", help="write a model as a Hugging Face directory (for vLLM, transformers)")
    x.add_argument("model", help=f"registry name ({', '.join(MODELS)}), .gguf path or HF dir")
    x.add_argument("out", help="the folder to create")
    x.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    x.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def _info_args(sub, names: list) -> None:
    i = sub.add_parser("info", help="model config, sizes, cache location, kernel backends")
    _common(i)

def _export_hf(args) -> int:
    from .integrations.hf_export import export_hf   # lazy: this subcommand's implementation (imports torch)

    out = export_hf(args.model, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(out)
    return 0


def _drop_stdout() -> None:
    """Point stdout at /dev/null: the exit's flush of what is still buffered would fail again, with a traceback."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _parse_kv(items) -> dict:
    out = {}
    for it in items:
        if "=" not in it:
            raise SwiftkError(f"--swift expects KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def _generate(a) -> int:
    if a.save_skip_set:
        check_output_path(a.save_skip_set, "--save-skip-set")
    # stdin before the slow load, bounded (the rest is left unread); the engine then refuses, before tokenizing, a
    # prompt too long for its context
    prompt = a.prompt if a.prompt is not None else sys.stdin.read(MAX_STDIN_CHARS + 1)
    if len(prompt) > MAX_STDIN_CHARS:
        raise SwiftkError(f"stdin holds over {MAX_STDIN_CHARS} characters: no prompt that long fits a context")

    # --swift KEY=VALUE: decode options apply to this call, optimizer options to the engine's learned state
    decode_kw, opt_kw = split_options(_parse_kv(a.swift))
    # the engine's default, resolved here so the checks below name what will run
    a.method = a.method or ("draft_model" if a.draft_model else "swift")
    if a.method == "draft_model" and not a.draft_model:
        raise SwiftkError("--method draft_model needs --draft-model NAME_OR_PATH")
    if a.draft_model and a.method != "draft_model":
        raise SwiftkError(f"--draft-model drafts for --method draft_model, not {a.method}")
    if a.save_skip_set and a.method != "swift":
        raise SwiftkError(f"--save-skip-set saves what --method swift optimizes, not {a.method}")
    if a.drafter and a.method != "moa":
        raise SwiftkError("--drafter is an option of --method moa")
    # CLI spellings in the messages: the API's own checks would name skip_set=, exit_layer=
    if a.skip_set and a.method not in ("swift", "static"):
        raise SwiftkError(f"--skip-set is an option of --method swift or static, not {a.method}")
    if a.method == "static" and not a.skip_set:
        raise SwiftkError("--method static needs --skip-set FILE (from --save-skip-set or swiftk optimize)")
    if (a.exit_layer is not None) != (a.method == "early_exit"):
        raise SwiftkError("--method early_exit needs --exit-layer E (the draft runs layers 0..E-1)"
                          if a.exit_layer is None else "--exit-layer is an option of --method early_exit")
    # a run from a given skip set is a one-off: it must not become the saved state later runs start from
    persist = False if a.skip_set else None
    eng = _load(a, drafter=a.drafter, draft_model=a.draft_model, persist=persist, **opt_kw,
                **load_time(a.draft_model, decode_kw))
    extra = {}
    if a.method == "static":
        extra["skip_set"] = a.skip_set
    elif a.skip_set:
        eng.states.load_skip_set(a.skip_set)
    stream = None if a.json else (lambda piece: print(piece, end="", flush=True))
    out = eng.generate(prompt, max_new_tokens=a.max_new_tokens, method=a.method, temperature=a.temperature,
                       top_k=a.top_k, top_p=a.top_p, seed=a.seed, stop=a.stop, chat=a.chat, callback=stream,
                       progress=a.json and sys.stderr.isatty(), exit_layer=a.exit_layer, **extra, **decode_kw)
    if a.save_skip_set:
        eng.states.save_skip_set(a.save_skip_set)
    if a.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "stats": out.stats.to_dict()}, indent=1))
    else:
        print()
        s = out.stats
        extra = ""
        if s["method"] != "autoregressive":
            extra = f", M={s['mean_accepted_length']:.2f}, alpha={s['acceptance_rate']:.2f}"
        print(f"[{s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, {s['method']}{extra}; {s['arithmetic']}]",
              file=sys.stderr)
    return 0


def _optimize(a) -> int:
    from .skipset_search import OfflineSearch, read_prompts   # lazy: this subcommand's implementation

    prompts = read_prompts(a.prompts)
    state = a.state or (a.out + ".state.json")
    check_output_path(a.out, "--out")
    check_output_path(state, "--state")
    eng = _load(a)
    search = OfflineSearch(eng, prompts, iterations=a.iterations, n_init=a.init, max_new_tokens=a.max_new_tokens,
                           chat=a.chat, state_path=state, seed=a.seed)
    best = search.run(progress=sys.stderr.isatty())
    path = search.write(a.out, best)
    s = eng.states.read_skip_set(path)
    print(f"{path}: {int(s.sum())} of {s.numel()} sublayers skipped; {best['tokens_per_s']:.1f} tok/s, "
          f"M={best['M']:.2f}, alpha={best['alpha']:.2f} on {len(prompts)} prompt(s) "
          f"(best of {len(search.history)}; state in {state})")
    return 0


def _train_drafter(a) -> int:
    from .moa import corpus, train   # lazy: this subcommand's implementation (imports torch)

    for name in ("tokens", "answer_tokens", "steps", "batch", "reuse"):
        if getattr(a, name) < 1:
            raise SwiftkError(f"--{name.replace('_', '-')} must be >= 1")
    if a.chunk < 16:
        raise SwiftkError(f"--chunk must be >= 16, got {a.chunk}")
    if not (a.lr > 0 and a.lr < float("inf")):
        raise SwiftkError(f"--lr must be a finite number > 0, got {a.lr}")
    if a.tli < 0:
        raise SwiftkError(f"--tli must be >= 0, got {a.tli}")
    eng = swiftk.load(a.model, persist=False)
    from .moa.method import trained_drafter_path   # lazy: imports torch (see _main)

    out = Path(a.out) if a.out else trained_drafter_path(eng.target)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_output_path(str(out), "--out")
    data = a.data or ["stdlib", "site-packages", "docs"]
    def answer(prompt: str, chat: bool) -> list:   # the target's own greedy answer (free drafts: exact, fast)
        r = eng.generate(prompt, chat=chat, max_new_tokens=a.answer_tokens, method="ngram")
        return r.prompt_ids + r.token_ids

    text = corpus.corpus(eng.target, data, a.tokens, answer, a.answer_tokens, progress=sys.stderr.isatty())
    recipe = {"command": "swiftk " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["train-drafter"] else None,
              "swiftk": swiftk.__version__, "commit": _commit(), "data": data, "tokens": a.tokens}
    rep = train.train(eng.target, text, out, steps=a.steps, batch=a.batch, chunk=a.chunk, reuse=a.reuse, lr=a.lr,
                      seed=a.seed, resume=a.resume, progress=sys.stderr.isatty(), recipe=recipe, tli=a.tli,
                      log=None if sys.stderr.isatty() else (lambda line: print(line, file=sys.stderr, flush=True)),
                      lsa=not a.no_lsa, anchor=a.anchor)
    h = rep["held_out"]
    print(f"{out}: {rep['parameters']:,} parameters, TLI {a.tli}{'' if not a.no_lsa else ', no LSA'}"
          f"{', anchor' if a.anchor else ''}; "
          f"{rep['train_tokens_seen']:,} corpus tokens seen in {rep['train_s']:.0f} s "
          f"({rep['target_s']:.0f} s of target passes); held-out greedy agreement by depth "
          f"{h['acceptance_by_depth']}, implied mean accepted length {h['mean_accepted_length']}")
    return 0


def _commit():
    """The checkout's commit, when swiftk runs from one (the drafter's recipe records it)."""
    import subprocess   # lazy: only train-drafter records its commit

    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True,
                           timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _pull(a) -> int:
    path = pull(a.name, progress=True, force=a.force, verify=a.verify)
    _build_corpus(path)
    print(path)
    return 0


def _build_corpus(path) -> None:
    """The corpus n-gram tables for this model's tokenizer, built now (they are built in the background otherwise,
    and a short first call would not profit from them)."""
    # lazy: only `swiftk pull` needs these (GGUF reader, tokenizer, corpus tables)
    from .proposers.datastore import cached_stdlib_datastore, corpus_fingerprint, stdlib_datastore
    from .loading.gguf import read_gguf
    from .loading.tokenizer import Tokenizer

    try:
        meta = read_gguf(path).metadata
        tok = Tokenizer.from_gguf_metadata({k: v for k, v in meta.items() if k.startswith("tokenizer.")})
    except SwiftkError as e:   # the download itself is done and verified; loading it will say what is wrong
        print(f"swiftk: corpus tables not built: {e}", file=sys.stderr)
        return
    fp, vocab = corpus_fingerprint(tok, {}), int(tok.vocab_size)
    if cached_stdlib_datastore(fp, vocab) is None:
        print("swiftk: building the corpus n-gram tables (Python stdlib) for this tokenizer ...", file=sys.stderr,
              flush=True)
        t = time.perf_counter()
        stdlib_datastore(tok, fp, vocab)
        print(f"swiftk: corpus tables built in {time.perf_counter() - t:.1f} s", file=sys.stderr)


def _serve(a) -> int:
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise SwiftkError(f"swiftk serve needs {' and '.join(missing)}: pip install -e \".[serve]\"")
    # lazy: the server extra (fastapi, checked just above) and torch, for this subcommand only
    from .serve import serve
    from .serve.app import check_origins

    if not 0 <= a.port <= 65535:
        raise SwiftkError(f"--port must be in [0, 65535], got {a.port}")
    try:   # before the slow load: an unknown host or a taken port would only show as uvicorn's log line
        socket.create_server((a.host, a.port)).close()
    except OSError as e:
        raise SwiftkError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None
    decode_kw, opt_kw = split_options(_parse_kv(a.swift))
    origins = [o.strip() for o in a.allowed_origins.split(",") if o.strip()]
    check_origins(origins)   # before the slow load
    template = read_text(a.chat_template, "chat template", MAX_JSON_BYTES) if a.chat_template else None
    if a.draft_model and a.method not in (None, "draft_model"):   # before loading two models
        raise SwiftkError(f"--draft-model drafts for --method draft_model, not {a.method}")
    eng = _load(a, max_context=a.max_context, draft_model=a.draft_model, **opt_kw,
                **load_time(a.draft_model, decode_kw))
    name = a.served_model_name or (a.model if a.model in MODELS else Path(a.model).name)
    print(f"swiftk serve: {name} on http://{a.host}:{a.port}/v1 (history scope: {a.history_scope})",
          file=sys.stderr, flush=True)
    try:
        serve(eng, name, host=a.host, port=a.port, log_level=a.log_level, api_keys=a.api_key,
              history_scope=a.history_scope, queue_size=a.queue_size, method=a.method, options=decode_kw,
              max_batch=a.max_batch, allowed_origins=origins, chat_template=template)
    except KeyboardInterrupt:   # uvicorn re-raises the SIGINT it handled once it has shut down
        return 130
    return 0


def _info(a) -> int:
    info = {"cache": str(swiftk_home()), "registry": {n: model_info(n) for n in MODELS}}
    eng = _load(a)
    info.update(eng.info())
    print(json.dumps(info, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
