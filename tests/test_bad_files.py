"""Hostile files and CLI runs, round 2: each case got a raw traceback, a hang or a silently wrong result before.
Now a SwiftkError naming the file and the problem, or (for swiftk's own state) a warning and a fresh start."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

import swiftk
from swiftk.errors import SwiftkError
from swiftk.loading.loaders import load_checkpoint
from swiftk.skipset_search import read_prompts
import test_bad_inputs as tb
import test_loaders as tl

REPO = Path(__file__).resolve().parents[1]


def default_sigint() -> None:
    """In a child about to run: Ctrl-C's default disposition, as at a terminal. A test run started in the
    background of a non-interactive shell ignores SIGINT, and children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def four_layers(monkeypatch):
    """The tiny writers' layer count raised to 4, so an Engine (layer skipping needs 3) loads them."""
    monkeypatch.setattr(tl, "L", 4)
    monkeypatch.setattr(tb, "L", 4)


def _cli(*args, home, **kw):
    env = {**os.environ, "SWIFTK_HOME": str(home)}
    env.pop("SWIFTK_PERSIST", None)
    return subprocess.run([sys.executable, "-m", "swiftk.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300, **kw)


# ------------------------------------------------------------------------------------------- paths and weights
def test_fifo_as_model_path_is_refused_not_read(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    code = f"import swiftk\ntry:\n    swiftk.load({str(fifo)!r})\nexcept swiftk.SwiftkError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)  # hang guard
    assert "not a regular file" in out.stdout, out.stderr[-2000:]


def test_nan_gguf_tensor_is_named(tmp_path):
    t = tl.hf_tensors("llama")
    k = "model.layers.1.mlp.down_proj.weight"
    t[k] = t[k].clone()
    t[k][3, 5] = float("nan")
    p = tmp_path / "nan.gguf"
    tl.write_tiny_gguf(p, "llama", tensors=t, qtypes={})
    with pytest.raises(SwiftkError, match=r"blk\.1\.ffn_down\.weight holds 1 NaN"):
        load_checkpoint(p)


def test_infinite_safetensors_value_is_named(tmp_path):
    d = tb._tiny_hf_dir(tmp_path)
    st = load_file(str(d / "model.safetensors"))
    st["model.norm.weight"][0] = float("inf")
    save_file(st, str(d / "model.safetensors"))
    with pytest.raises(SwiftkError, match=r"model\.norm\.weight holds 1 NaN or infinite"):
        load_checkpoint(d)


def _index_entry(data: bytearray, name: str) -> int:
    """Offset of a tensor's type field in a GGUF's tensor index."""
    k = name.encode()
    i = data.index(len(k).to_bytes(8, "little") + k) + 8 + len(k)
    return i + 4 + 8 * int.from_bytes(data[i:i + 4], "little")


@pytest.mark.parametrize("damage", ["overlap", "type-f16", "type-q8_0"])
def test_damaged_tensor_index_is_caught(tmp_path, damage):
    p = tmp_path / "m.gguf"
    tl.write_tiny_gguf(p, "llama", qtypes={})
    data = bytearray(p.read_bytes())
    norm, emb = _index_entry(data, "output_norm.weight"), _index_entry(data, "token_embd.weight")
    if damage == "overlap":   # the norm's offset pointed into the embedding's bytes
        data[norm + 4:norm + 12] = data[emb + 4:emb + 12]
    else:                     # a flipped type byte: the same bytes read as another format
        data[norm:norm + 4] = int(gguf.GGMLQuantizationType.F16 if damage == "type-f16"
                                  else gguf.GGMLQuantizationType.Q8_0).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    with pytest.raises(SwiftkError, match="overlap|unused bytes after tensor output_norm"):
        load_checkpoint(p)


def test_tokenizer_larger_than_the_embedding(tmp_path):
    from tokenizers import Tokenizer as HFTok, models, pre_tokenizers

    d = tb._tiny_hf_dir(tmp_path)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(600)]
    tok = HFTok(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    with pytest.raises(SwiftkError, match="tokenizer has 603 tokens but the embedding only"):
        load_checkpoint(d)


# ------------------------------------------------------------------------------------------- tokenizer metadata
@pytest.mark.parametrize("method, replacement, pattern", [
    ("add_token_types", lambda self, types: self.add_array("tokenizer.ggml.token_type", types[:5]),
     "token_type must be .* one per token"),
    ("add_token_merges", lambda self, merges: self.add_array("tokenizer.ggml.merges", [1, 2, 3]),
     "merges must be a list of strings"),
    ("add_bos_token_id", lambda self, i: self.add_string("tokenizer.ggml.bos_token_id", "1"),
     "bos_token_id must be token ids"),
    ("add_eos_token_id", lambda self, i: self.add_uint32("tokenizer.ggml.eos_token_id", 10**6),
     "eos_token_id must be token ids"),
])
def test_bad_gguf_tokenizer_metadata_is_named(tmp_path, monkeypatch, method, replacement, pattern):
    monkeypatch.setattr(gguf.GGUFWriter, method, replacement)
    p = tmp_path / "m.gguf"
    tl.write_tiny_gguf(p, "llama")
    with pytest.raises(SwiftkError, match=pattern):
        load_checkpoint(p)


@pytest.mark.parametrize("name, content, pattern", [
    ("tokenizer_config.json", {"eos_token": 5}, "eos_token in tokenizer_config.json must be a string"),
    ("tokenizer_config.json", {"chat_template": 7}, "chat_template must be a string"),
    ("tokenizer_config.json", {"add_bos_token": "yes"}, "add_bos_token a bool"),
    ("generation_config.json", {"eos_token_id": "x"}, "eos_token_id in generation_config.json must be token ids"),
    ("generation_config.json", {"eos_token_id": [2, -1]}, "must be token ids"),
    ("generation_config.json", [], "must hold a JSON object, got array"),
    ("model.safetensors.index.json", {"weight_map": 3}, "weight_map must map tensor names"),
    ("model.safetensors.index.json", {"weight_map": {"a": "../x.safetensors"}}, "weight_map must map tensor names"),
])
def test_malformed_hf_side_files_are_named(tmp_path, name, content, pattern):
    d = tb._tiny_hf_dir(tmp_path)
    (d / name).write_text(json.dumps(content))
    with pytest.raises(SwiftkError, match=pattern):
        load_checkpoint(d)


@pytest.mark.parametrize("text, pattern", [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                           (b"\xff\xfe{}", "not UTF-8"), ('{"a": NaN}', "a holds NaN, not a finite number")])
def test_hostile_config_json(tmp_path, text, pattern):
    d = tb._tiny_hf_dir(tmp_path)
    (d / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(SwiftkError, match=pattern):
        load_checkpoint(d)


# ------------------------------------------------------------------------------------------- config semantics
def test_sliding_window_caps_the_context(tmp_path):
    d = tb._tiny_hf_dir(tmp_path, "mistral", config=tb._hf_config(model_type="mistral", sliding_window=64))
    assert load_checkpoint(d).config.max_position == 64
    qwen = dict(model_type="qwen2", sliding_window=64, attention_bias=False)
    off = tb._tiny_hf_dir(tmp_path, "qwen", config=tb._hf_config(**qwen, use_sliding_window=False))
    assert load_checkpoint(off).config.max_position == 256   # a window that is switched off changes nothing
    on = tb._tiny_hf_dir(tmp_path, "qwen-on", config=tb._hf_config(**qwen, use_sliding_window=True))
    assert load_checkpoint(on).config.max_position == 64


def test_context_length_one_is_named(tmp_path, four_layers):
    p = tb._tiny_gguf(tmp_path, context_length=1)
    with pytest.raises(SwiftkError, match="context length is 1 tokens"):
        swiftk.load(str(p), persist=False)


def test_float16_on_cpu_is_refused_up_front(tmp_path):
    with pytest.raises(SwiftkError, match="float16 is for GPUs"):
        swiftk.load(str(tmp_path / "never-read"), dtype="float16")


# ------------------------------------------------------------------------------------------- swiftk's own files
def test_state_with_infinity_is_ignored_with_a_warning(tmp_path, monkeypatch, four_layers):
    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path / "home"))
    d = tb._tiny_hf_dir(tmp_path)
    eng = swiftk.load(str(d), persist=True)
    eng.generate("w1 w2 w3", max_new_tokens=4)
    path = eng.states.path
    text = path.read_text()
    assert '"tokens_seen": ' in text
    path.write_text(text.replace('"tokens_seen": ', '"tokens_seen": Infinity, "was": ', 1))
    with pytest.warns(UserWarning, match="ignoring the saved decoding state .*tokens_seen holds Infinity") as rec:
        again = swiftk.load(str(d), persist=True)
    assert rec[0].filename == __file__   # points at the caller's line, not an internal one
    assert again.state.tokens_seen == 0
    assert again.generate("w1 w2 w3", max_new_tokens=4).token_ids == eng.generate(
        "w1 w2 w3", max_new_tokens=4, method="autoregressive").token_ids


def test_prompt_files_with_bad_bytes_or_shapes(tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"\xff\xfe hello\n")
    with pytest.raises(SwiftkError, match="not UTF-8"):
        read_prompts(bad)
    odd = tmp_path / "p.jsonl"
    odd.write_text('{"turns": 5}\n')
    with pytest.raises(SwiftkError, match="expected a string prompt"):
        read_prompts(odd)
    odd.write_text('{"turns": "abc"}\n')
    with pytest.raises(SwiftkError, match="expected a string prompt"):
        read_prompts(odd)


# ------------------------------------------------------------------------------------------- CLI
@pytest.fixture
def tiny4(tmp_path, four_layers):
    return tb._tiny_hf_dir(tmp_path)


def test_cli_refuses_skip_set_for_methods_that_ignore_it(tmp_path, tiny4):
    sk = tmp_path / "skip.json"
    sk.write_text(json.dumps({"attention": [1], "mlp": []}))
    out = _cli("generate", "w1 w2", "-n", "3", "--model", str(tiny4), "--method", "ngram", "--skip-set", str(sk),
               home=tmp_path / "home")
    assert out.returncode == 2 and "--skip-set is an option of --method swift or static" in out.stderr


def test_cli_skip_set_run_is_not_persisted(tmp_path, tiny4):
    home = tmp_path / "home"
    sk = tmp_path / "skip.json"
    eng = swiftk.load(str(tiny4), persist=False)
    eng.states.save_skip_set(str(sk))
    out = _cli("generate", "w1 w2", "-n", "3", "--model", str(tiny4), "--skip-set", str(sk), home=home)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not list((home / "state").glob("*.json")) if (home / "state").exists() else True
    plain = _cli("generate", "w1 w2", "-n", "3", "--model", str(tiny4), home=home)
    assert plain.returncode == 0 and list((home / "state").glob("*.json"))   # a normal run does persist


@pytest.mark.parametrize("args", [["generate", "--dtype", "float16"]])
def test_cli_float16_on_cpu_is_one_line(tmp_path, tiny4, args):
    out = _cli(*args, "w1", "--model", str(tiny4), home=tmp_path / "home")
    assert out.returncode == 2 and "float16 is for GPUs" in out.stderr and "Traceback" not in out.stderr


def test_cli_ctrl_c_exits_130_without_traceback(tmp_path, tiny4):
    env = {**os.environ, "SWIFTK_HOME": str(tmp_path / "home"), "SWIFTK_PERSIST": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "swiftk.cli", "generate", "--model", str(tiny4)],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=default_sigint)
    wchan = Path(f"/proc/{proc.pid}/wchan")
    deadline = time.monotonic() + 120   # a hang guard: wait until it blocks reading the prompt from stdin
    while "pipe_read" not in (wchan.read_text() if wchan.exists() else "pipe_read"):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    proc.stdin.close() if proc.stdin else None
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip() == "swiftk: interrupted"


@pytest.mark.parametrize("args, message", [
    (["--method", "static"], "--method static needs --skip-set FILE"),
    (["--method", "early_exit"], "--method early_exit needs --exit-layer E"),
    (["--exit-layer", "2"], "--exit-layer is an option of --method early_exit"),
])
def test_cli_messages_use_cli_spellings(capsys, args, message):
    from swiftk.cli import main

    assert main(["generate", "w1", "--model", "never-loaded", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "=" not in err.split("error:")[1].split("(")[0]


# ------------------------------------------------------------------------------------------- sweep findings
def test_integer_weights_are_refused(tmp_path):
    d = tb._tiny_hf_dir(tmp_path)
    st = load_file(str(d / "model.safetensors"))
    st["model.layers.0.self_attn.q_proj.weight"] = st["model.layers.0.self_attn.q_proj.weight"].to(torch.int32)
    save_file(st, str(d / "model.safetensors"))
    with pytest.raises(SwiftkError, match="q_proj.weight has dtype int32; weights must be floating point"):
        load_checkpoint(d)


@pytest.mark.parametrize("model", [None, 5, 2.5])
def test_model_of_the_wrong_type(model):
    with pytest.raises(SwiftkError, match="model must be a registry name or a path"):
        swiftk.load(model)


def test_api_misuse_found_by_the_sweep(tmp_path, tiny4):
    eng = swiftk.load(str(tiny4), persist=False)
    with pytest.raises(SwiftkError, match="temperature must be <="):
        eng.generate("w1", max_new_tokens=2, temperature=10**30)
    with pytest.raises(SwiftkError, match="callback is an option of generate"):
        list(eng.stream("w1", max_new_tokens=2, callback=print))
    with pytest.raises(SwiftkError, match="is a directory"):
        eng.states.save_skip_set(str(tmp_path))
    # a callback that streams from its own engine would wait forever for the engine it holds
    with pytest.raises(SwiftkError, match="cannot call back into the same engine"):
        eng.generate("w1 w2", max_new_tokens=4, method="autoregressive",
                     callback=lambda p: list(eng.stream("w1", max_new_tokens=2)))
    ref = eng.generate("w1 w2", max_new_tokens=6, method="autoregressive")
    assert "".join(eng.stream("w1 w2", max_new_tokens=6, method="autoregressive")) == ref.text   # still usable


def test_cli_output_and_training_inputs_checked_before_work(tmp_path, tiny4):
    prompts = tmp_path / "p.txt"
    prompts.write_text("w1 w2\n")
    out = _cli("optimize", "--model", str(tiny4), "--prompts", str(prompts), "--out", str(tmp_path), "--iterations",
               "1", home=tmp_path / "home")
    assert out.returncode == 2 and "--out" in out.stderr and "is a directory" in out.stderr
    bad = tmp_path / "b.txt"
    bad.write_bytes(b"hi \xff\xfe\n")
    out = _cli("train-drafter", "--model", str(tiny4), "--data", str(bad), "--steps", "1", "--tokens", "200",
               "--out", str(tmp_path / "d.safetensors"), home=tmp_path / "home")
    assert out.returncode == 2 and "not UTF-8" in out.stderr and "Traceback" not in out.stderr
    out = _cli("train-drafter", "--model", str(tiny4), "--lr", "nan", home=tmp_path / "home")
    assert out.returncode == 2 and "--lr must be a finite number" in out.stderr


# ------------------------------------------------------------------------------------------- sweep round 3
_READERS = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))   # /dev/zero read whole would pass this
import torch
from swiftk import files
from swiftk import skipset_search as selfsd
from swiftk.runtime import skipset
from swiftk.proposers.datastore import Datastore
from swiftk.errors import SwiftkError
from swiftk.moa import model as moa_model
from pathlib import Path
from swiftk.runtime.ops import native_build
path = sys.argv[1]
calls = {"read_bytes": lambda: files.read_bytes(path), "read_text": lambda: files.read_text(path),
         "read_json": lambda: files.read_json(path), "skip set": lambda: skipset.read(path, {}, 4),
         "prompts": lambda: selfsd.read_prompts(path), "corpus table": lambda: Datastore.load(path),
         "drafter": lambda: moa_model.load(path)}
for name, call in calls.items():
    try:
        call()
        print(name, "READ")
    except SwiftkError as e:
        print(name, "refused:", e)
why = native_build.verify(Path(path))   # a kernel library: not trusted, rebuilt
print("kernel library", "refused:" if why else "TRUSTED", why)
"""


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "oversized"])
def test_every_reader_refuses_fifos_devices_and_huge_files(tmp_path, kind):
    """Files swiftk reads whole go through one bounded reader: a FIFO would hang, /dev/zero fill memory."""
    p = tmp_path / "thing.json"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev-zero":
        p.symlink_to("/dev/zero")
    else:
        with open(p, "wb") as f:   # sparse: 2 GiB of nothing on disk
            f.truncate(2 << 30)
    out = subprocess.run([sys.executable, "-c", _READERS, str(p)], capture_output=True, text=True,
                         timeout=240)   # a hang guard
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and len(lines) == 8, out.stderr[-3000:]
    for line in lines:
        assert "refused:" in line and str(p) in line, line
        assert "not a regular file" in line if kind != "oversized" else "not a regular file" not in line, line


def test_skip_set_from_a_device_or_fifo_is_refused(tmp_path, tiny4):
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); import swiftk\n"
            f"eng = swiftk.load({str(tiny4)!r}, persist=False)\n"
            "try:\n    eng.generate('w1', max_new_tokens=2, method='static', skip_set='/dev/zero')\n"
            "except swiftk.SwiftkError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert "skip set file /dev/zero is not a regular file" in out.stdout, out.stderr[-2000:]
    fifo = tmp_path / "skip.json"
    os.mkfifo(fifo)
    out = _cli("generate", "w1", "-n", "2", "--model", str(tiny4), "--skip-set", str(fifo), home=tmp_path / "h")
    assert out.returncode == 2 and "is not a regular file" in out.stderr, out.stderr[-2000:]


def test_gguf_metadata_of_the_wrong_type_is_named(tmp_path, monkeypatch):
    def freq_base_and_bad_factor(self, v):
        self.add_float32("llama.rope.freq_base", v)
        self.add_string("llama.rope.scaling.factor", "x")

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_freq_base", freq_base_and_bad_factor)
    p = tmp_path / "m.gguf"
    tl.write_tiny_gguf(p, "llama")
    with pytest.raises(SwiftkError, match="llama.rope.scaling.factor must be a finite number > 0, got 'x'"):
        load_checkpoint(p)


def test_cached_model_path_that_is_a_directory_is_named_before_any_download(tmp_path, monkeypatch):
    from swiftk.loading import registry

    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path))
    monkeypatch.setattr(registry, "_download", lambda *a: pytest.fail("downloaded over a directory"))
    (tmp_path / "models" / registry._spec(swiftk.DEFAULT_MODEL).filename).mkdir(parents=True)
    with pytest.raises(SwiftkError, match="is not a regular file .*remove it"):
        swiftk.pull(swiftk.DEFAULT_MODEL, progress=False)


@pytest.mark.parametrize("bins", [[1, 2], "x", [(0.5,)], [(0.5, 2, 3)], 7])
def test_malformed_topk_bins_are_named(tmp_path, tiny4, bins):
    eng = swiftk.load(str(tiny4), persist=False)
    with pytest.raises(SwiftkError, match="topk_greedy must be"):
        eng.generate("w1", max_new_tokens=2, topk_greedy=bins)


def test_cli_output_that_cannot_be_written_is_one_line(tmp_path, tiny4):
    env = {**os.environ, "SWIFTK_HOME": str(tmp_path / "h"), "SWIFTK_PERSIST": "0"}
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", "swiftk.cli", "generate", "w1 w2", "-n", "4", "--model",
                              str(tiny4), "--method", "autoregressive"], stdout=full, stderr=subprocess.PIPE,
                             text=True, env=env, timeout=300)
    assert out.returncode == 1 and "No space left on device" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr


def test_cli_ctrl_c_while_torch_imports_is_one_line(tmp_path):
    env = {**os.environ, "SWIFTK_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "swiftk.cli", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=default_sigint)
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 120   # a hang guard: wait until torch's library is being loaded
    while "libtorch" not in (maps.read_text() if maps.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip() == "swiftk: interrupted", err[-2000:]


def test_corpus_table_with_zero_counts_is_rebuilt_with_a_warning(tmp_path, monkeypatch):
    import numpy as np

    import swiftk.proposers.datastore as dsm

    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path))
    good = dsm.Datastore.build([5, 6, 7, 5, 6, 7, 5, 6, 8])
    good.tables[2] = (good.tables[2][0], good.tables[2][1], np.zeros_like(good.tables[2][2]), good.tables[2][3] * 0)
    path = dsm._table_path("fp", dsm.DEFAULT_MAX_TOKENS)
    path.parent.mkdir(parents=True)
    good.save(path, "fp")
    with pytest.raises(SwiftkError, match="corrupt tables"):
        dsm.Datastore.load(path, "fp", 100)
    with pytest.warns(UserWarning, match="rebuilding the corpus table"):
        assert dsm.cached_stdlib_datastore("fp", 100) is None
    assert not path.exists()   # removed, so the next load rebuilds it


def test_misspelt_skip_set_keys_are_refused(tmp_path, tiny4):
    from swiftk.runtime import skipset

    eng = swiftk.load(str(tiny4), persist=False)
    with pytest.raises(SwiftkError, match="skip_set: unknown key\\(s\\) 'attn'"):
        eng.generate("w1", max_new_tokens=2, method="static", skip_set={"attn": [1]})
    f = tmp_path / "s.json"
    eng.states.save_skip_set(str(f), skip_set=skipset.from_layers(4, [1], []))
    data = json.loads(f.read_text())
    f.write_text(json.dumps({**data, "mlps": [2]}))
    with pytest.raises(SwiftkError, match="unknown key\\(s\\) 'mlps'"):
        eng.states.read_skip_set(str(f))
    with pytest.raises(SwiftkError, match="save_skip_set: unknown key\\(s\\) 'note'"):
        eng.states.save_skip_set(str(tmp_path / "t.json"), note="x")


@pytest.mark.parametrize("body, param", [
    ({"temperature": "0"}, "temperature"), ({"max_tokens": 4.0}, "max_tokens"), ({"top_p": True}, "top_p"),
    ({"seed": "1"}, "seed"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": "true"}, "stream"), ({"n": "1"}, "n"), ({"user": 5}, "user"),
])
def test_server_fields_are_strict_alike(body, param):
    from swiftk.serve import api

    with pytest.raises(api.APIError) as e:
        api.parse(api.CompletionRequest, {"model": "m", "prompt": "hi", **body})
    assert e.value.status == 400 and e.value.param == param
    ok = api.parse(api.CompletionRequest, {"model": "m", "prompt": "hi", "temperature": 0, "stream": True,
                                           "stream_options": {"include_usage": True}})
    assert ok.temperature == 0.0 and ok.stream_options.include_usage


def test_package_names_survive_lazy_imports():
    """swiftk imports torch on first use; the function swiftk.generate keeps its name whichever submodule loads
    first (a submodule named generate would shadow it)."""
    code = ("import sys, swiftk\nassert 'torch' not in sys.modules\nfrom swiftk.decoding.output import GenerationResult\n"
            "assert callable(swiftk.generate) and callable(swiftk.load) and swiftk.GenerationResult is GenerationResult"
            "\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
