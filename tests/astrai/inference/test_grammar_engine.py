"""Grammar-constrained decoding in the engine, on a tiny random model (it never writes valid JSON by itself).

Constrained output always parses and validates (seeds at temperature 1, n = 2, prefix-cache hits, forced
preemption, a regex, a choice list); unconstrained rows sharing the batch get exactly the tokens they get alone; a
bad grammar is an `EngineInputError` from `submit` naming its field, and the engine keeps serving; the sampler
applies the mask before everything else.
"""

import json
import re

import attrs
import pytest
import torch

import astrai
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.errors import EngineInputError
from astrai.inference.grammar import allocate_bitmask
from astrai.inference.params import GrammarSpec, SamplingParams
from astrai.inference.sampler import sample
from astrai.inference.sampling_batch import make_sampling_batch
from helpers import tiny_model_dir, valid_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "age", "ok"],
    "additionalProperties": False,
}
JSON = GrammarSpec(kind="json_schema", source=json.dumps(SCHEMA))
PROMPT = "the quick brown fox jumps over the lazy dog, hello world"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return astrai.load(tiny_model_dir(tmp_path_factory.mktemp("grammar") / "m"))


def _engine(model, **kw) -> Engine:
    cfg = {"compile": False, "background": False, "kv_budget_tokens": 4096, "page_size": 4, **kw}
    return Engine(model, EngineConfig(**cfg))


def _valid(text: str) -> bool:
    return valid_json(text, SCHEMA)


def _assert_clean(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0
    if engine.radix is not None:
        engine.radix.reset()
    assert engine.pool.num_free == engine.pool.num_pages - 1


def test_json_schema_always_validates_and_the_unconstrained_control_does_not(model):
    with _engine(model) as engine:
        constrained = [SamplingParams(max_tokens=160, temperature=1.0, seed=s, grammar=JSON) for s in range(10)]
        pair = SamplingParams(max_tokens=160, temperature=1.0, seed=3, n=2, grammar=JSON)
        # negative control, in the same batch: the same requests without the constraint never give valid JSON
        free = [SamplingParams(max_tokens=32, temperature=1.0, seed=s) for s in range(10)]
        out = engine.generate([PROMPT] * 21, [*constrained, pair, *free])
        for c in out[:10]:
            o = c.outputs[0]
            assert o.finish_reason == "stop" and _valid(o.text), o.text
            assert not set(o.token_ids) & set(model.eos_token_ids)  # ended by the grammar, no EOS sampled
        two = out[10].outputs
        assert len(two) == 2 and two[0].text != two[1].text
        assert all(o.finish_reason == "stop" and _valid(o.text) for o in two)
        assert engine.radix.hit_tokens > 0  # the n = 2 follower took the leader's prompt from the prefix cache
        assert not any(_valid(c.outputs[0].text) for c in out[11:])
        _assert_clean(engine)


def test_unconstrained_rows_get_the_same_tokens_in_a_mixed_batch(model):
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=True)
    prompts = [PROMPT, "hello world, this is"]
    with _engine(model) as engine:
        alone = engine.generate(prompts, greedy)
    with _engine(model) as engine:
        constrained = SamplingParams(max_tokens=160, temperature=1.0, seed=7, n=2, grammar=JSON)
        mixed = engine.generate([prompts[0], "this is", prompts[1], "the lazy dog"],
                                [greedy, constrained, greedy, constrained])  # fmt: skip
    for a, m in zip(alone, [mixed[0], mixed[2]], strict=True):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
        assert m.outputs[0].logprobs == pytest.approx(a.outputs[0].logprobs, abs=1e-5)  # batched matmul rounding
    assert all(_valid(o.text) for c in (mixed[1], mixed[3]) for o in c.outputs)


def test_preemption_keeps_the_matchers_valid(model):
    # 96 tokens of KV for four requests of ~60 tokens: they preempt each other and are recomputed
    with _engine(model, kv_budget_tokens=96, max_running=4, prefix_cache=False) as engine:
        params = [SamplingParams(max_tokens=90, temperature=1.0, seed=s, grammar=JSON) for s in range(4)]
        out = engine.generate(["hello world"] * 4, params)
        assert engine.stats().preemptions > 0
        assert all(c.outputs[0].finish_reason == "stop" and _valid(c.outputs[0].text) for c in out)
        _assert_clean(engine)


def test_regex_choice_stop_strings_and_min_tokens(model):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    choices = ("yes", "no", "maybe later")
    regex, choice = GrammarSpec(kind="regex", source=pattern), GrammarSpec(kind="choice", source=list(choices))
    params = [SamplingParams(max_tokens=20, seed=s, grammar=regex) for s in range(4)]
    params += [SamplingParams(max_tokens=20, seed=s, grammar=choice, min_tokens=2) for s in range(4)]
    # a stop string inside the constrained text still cuts it
    params.append(SamplingParams(max_tokens=160, seed=1, grammar=JSON, stop=('"kind"',)))
    with _engine(model) as engine:
        out = [c.outputs[0] for c in engine.generate([PROMPT] * len(params), params)]
        _assert_clean(engine)
    assert all(o.finish_reason == "stop" for o in out)
    assert all(re.fullmatch(pattern, o.text) for o in out[:4]), [o.text for o in out[:4]]
    assert all(o.text in choices for o in out[4:8])
    text = out[8].text
    assert text.startswith('{"name":"') and text.endswith('",') and '"kind"' not in text and json.loads(text[8:-1])


def test_prepare_grammar_builds_the_view_that_requests_then_use(model):
    with _engine(model) as engine:
        assert engine._grammar_view is None  # lazy by default
        assert engine.prepare_grammar() is True
        view = engine._grammar_view
        assert view is not None and engine.compile_grammar(JSON).view is view
    no_tokenizer = attrs.evolve(model, tokenizer=None)
    with _engine(no_tokenizer) as engine:
        assert engine.prepare_grammar() is False  # and the first constrained request gets the error
        with pytest.raises(EngineInputError, match="no tokenizer"):
            engine.compile_grammar(JSON)


def test_bad_grammars_are_input_errors_from_submit(model):
    with _engine(model) as engine:
        bad = [
            GrammarSpec(kind="json_schema", source='{"type": "nonsense"}', param="response_format"),
            GrammarSpec(kind="json_schema", source="{not json", param="guided_json"),
            GrammarSpec(kind="regex", source="[a-", param="guided_regex"),
            GrammarSpec(kind="lark", source="start: ???", param="guided_grammar"),
            GrammarSpec(kind="choice", source=[], param="guided_choice"),
            GrammarSpec(kind="xml", source="x"),
        ]
        for spec in bad:
            with pytest.raises(EngineInputError) as err:
                engine.submit(PROMPT, SamplingParams(grammar=spec))
            assert err.value.param == spec.param
        assert not engine.scheduler.has_work()
        ok = engine.generate([PROMPT], SamplingParams(max_tokens=20, grammar=GrammarSpec(kind="choice", source=["x"])))
        assert ok[0].outputs[0].text == "x"


def test_sampler_applies_the_mask_before_bias_penalties_and_filters():
    vocab, rows = 70, 3
    logits = torch.randn(rows, vocab)
    logits[:, 5] = 50.0  # the favourite everywhere
    params = [SamplingParams(temperature=t, top_k=2, repetition_penalty=1.3, logit_bias={5: 100.0, 66: -100.0})
              for t in (0.0, 1.0, 1.0)]  # fmt: skip
    bitmask = allocate_bitmask(rows, vocab)
    bitmask[0, 2] = 1 << 1  # row 0: only token 65 (= 2 * 32 + 1) is allowed
    bitmask[1, 2] = 1 << 2  # row 1: only token 66, despite its -100 bias
    bitmask[2] = -1  # row 2: unconstrained (all ones)
    kw = {"seeds": [1, 2, 3], "steps": [0, 0, 0], "vocab_size": vocab, "device": "cpu", "outputs": [[5], [5], [5]]}
    masked = sample(logits, make_sampling_batch(params, grammar_bitmask=bitmask, **kw), want_logprobs=True)
    free = sample(logits, make_sampling_batch(params, **kw), want_logprobs=True)
    assert masked.tokens.tolist()[:2] == [65, 66]
    assert masked.tokens[2] == free.tokens[2]
    assert torch.equal(masked.logprobs[2], free.logprobs[2])
