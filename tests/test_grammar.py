"""Constrained decoding (swiftk.Grammar): every token is the target's choice among what the grammar allows, so the
default method (free drafts, the grammar's forced tokens) and a batch give exactly plain constrained decoding, and
seeded sampling draws from the target distribution restricted to the grammar."""
import json
import math
import re

import pytest
import torch

import swiftk
from swiftk.decoding.grammar import ll_tokenizer
from swiftk.errors import SwiftkError

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "is_active": {"type": "boolean"}, "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "email", "is_active", "languages"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me a JSON object describing a programmer named Ada."}]


@pytest.fixture(scope="module")
def eng(smollm2_path):
    return swiftk.load(str(smollm2_path), persist=False)


def _valid(obj) -> bool:
    types = {"name": str, "age": int, "email": str, "is_active": bool, "languages": list}
    return (set(obj) == set(types) and all(isinstance(obj[k], t) for k, t in types.items())
            and not isinstance(obj["age"], bool) and len(obj["languages"]) <= 3
            and all(isinstance(x, str) for x in obj["languages"]))


def test_schema_output_is_plain_constrained_decoding_and_valid(eng):
    g = swiftk.Grammar.json_schema(SCHEMA)
    ref = eng.generate(ASK, chat=True, max_new_tokens=120, method="autoregressive", grammar=g)
    assert ref.finish_reason == "eos" and _valid(json.loads(ref.text)), ref.text
    spec = eng.generate(ASK, chat=True, max_new_tokens=120, grammar=g)
    assert spec.token_ids == ref.token_ids
    assert spec.stats.accepted_by_source.get("grammar", 0) > 0   # forced tokens were drafted and accepted
    assert spec.stats.decoding_steps < len(spec.token_ids)
    for kw in ({"speculate": "always"}, {"method": "ngram"}):
        assert eng.generate(ASK, chat=True, max_new_tokens=120, grammar=g, **kw).token_ids == ref.token_ids
    bob = [{"role": "user", "content": "Describe a data engineer named Bob as JSON."}]
    many = eng.generate_many([ASK, bob, ASK], chat=True, max_new_tokens=120, grammar=g)
    assert many[0].token_ids == many[2].token_ids == ref.token_ids
    assert many[1].finish_reason == "eos" and _valid(json.loads(many[1].text)), many[1].text
    free = eng.generate(ASK, chat=True, max_new_tokens=40, method="autoregressive")
    assert free.token_ids != ref.token_ids[:len(free.token_ids)]   # the grammar did constrain this prompt


def test_seeded_constrained_sampling_equals_plain_and_stays_in_the_grammar(eng):
    g = swiftk.Grammar.json_object()
    for seed in (1, 2, 3):
        ar = eng.generate(ASK, chat=True, max_new_tokens=60, method="autoregressive", grammar=g, temperature=0.9,
                          seed=seed, top_p=0.95)
        spec = eng.generate(ASK, chat=True, max_new_tokens=60, grammar=g, temperature=0.9, seed=seed, top_p=0.95)
        assert spec.token_ids == ar.token_ids
        assert ar.text.lstrip().startswith("{")


def test_sampling_draws_from_the_distribution_restricted_to_the_grammar(eng):
    """The first token of a regex-constrained sample, over 300 seeds, against softmax(logits) over the tokens the
    grammar allows first (renormalized): every allowed token within 4 standard deviations, none other drawn."""
    g = swiftk.Grammar.regex(r"(yes|no|maybe|never)")
    prompt = "Q: Is the sky green? A:"
    ids = eng.encode_prompt(prompt)
    logits = eng.logits(ids)[-1].double()
    allowed = torch.from_numpy(g.matcher(ll_tokenizer(eng.tokenizer, eng.config.vocab_size)).allowed())
    p = torch.softmax(logits.masked_fill(~allowed[:logits.shape[0]], float("-inf")), -1)
    n, counts = 300, {}
    for seed in range(n):
        t = eng.generate(prompt, max_new_tokens=4, grammar=g, temperature=1.0, seed=seed).token_ids[0]
        counts[t] = counts.get(t, 0) + 1
    assert all(bool(allowed[t]) for t in counts)
    for t in set(counts) | {int(i) for i in torch.nonzero(p > 0.02).flatten()}:
        want = float(p[t]) * n
        assert abs(counts.get(t, 0) - want) <= 4 * math.sqrt(want * (1 - float(p[t]))) + 1, (t, counts.get(t), want)


def test_regex_and_lark_grammars_shape_the_output(eng):
    r = eng.generate("The date today, as YYYY-MM-DD:", max_new_tokens=20,
                     grammar=swiftk.Grammar.regex(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"))
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.text), r.text
    lark = swiftk.Grammar.lark('start: "def " NAME "(" NAME "):"\nNAME: /[a-z_]{1,12}/')
    r = eng.generate("# a Python function\n", max_new_tokens=20, grammar=lark)
    assert re.fullmatch(r"def [a-z_]{1,12}\([a-z_]{1,12}\):", r.text), r.text
    assert r.token_ids == eng.generate("# a Python function\n", max_new_tokens=20, grammar=lark,
                                       method="autoregressive").token_ids


def test_bad_grammars_are_refused_clearly(eng):
    with pytest.raises(SwiftkError, match="swiftk.Grammar"):
        eng.generate("x", max_new_tokens=2, grammar={"type": "object"})
    with pytest.raises(SwiftkError, match="regex grammar is invalid"):
        eng.generate("x", max_new_tokens=2, grammar=swiftk.Grammar.regex("(unclosed"))
    with pytest.raises(SwiftkError, match="json_schema is not valid JSON"):
        swiftk.Grammar.json_schema("{not json")
    with pytest.raises(SwiftkError, match="json_schema must be a JSON object"):
        swiftk.Grammar.json_schema([1, 2])
    with pytest.raises(SwiftkError, match="sampling='coupled'"):
        eng.generate("x", max_new_tokens=2, grammar=swiftk.Grammar.json_object(), temperature=0.7, seed=1,
                     sampling="rejection")


def test_the_mask_forbids_exactly_what_the_grammar_refuses(eng):
    st = swiftk.Grammar.regex(r"[0-9]+").matcher(ll_tokenizer(eng.tokenizer, eng.config.vocab_size))
    row = torch.randn(1, eng.config.vocab_size)
    masked = st.mask(row)
    ok = torch.from_numpy(st.allowed())
    assert torch.equal(masked[0][ok], row[0][ok]) and bool(torch.isinf(masked[0][~ok]).all())
    digits = [i for i in range(eng.config.vocab_size) if bool(ok[i])]
    assert digits and all(eng.tokenizer.decode([i]).strip().isdigit() for i in digits[:50])
