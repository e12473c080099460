"""`astrai.chat` against transformers' `apply_chat_template` + greedy `generate` on the same tiny random weights,
and the one-BOS rule for chat and for rendered template text passed to `astrai.generate`.

The tokenizer is Llama-3-shaped: its post-processor adds `<|begin_of_text|>` and its chat template renders
`<|begin_of_text|>` too, so encoding rendered template text naively yields two BOS tokens.
"""

import pytest
import torch
from tokenizers import processors
from transformers import AutoTokenizer

import astrai
from astrai.inference.engine import Engine
from astrai.io.tokenizer import train_tokenizer
from helpers import save_hf, tiny_hf_model

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
CONVERSATIONS = [
    [{"role": "user", "content": "hello, how are you?"}],
    [
        {"role": "system", "content": "the quick brown fox"},
        {"role": "user", "content": "jumps over the lazy dog"},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "how are you today?"},
    ],
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    corpus = ["hello world, how are you today?", "the quick brown fox jumps over the lazy dog"] * 4
    tok = train_tokenizer(corpus, vocab_size=300, special_tokens=SPECIALS, bos_token="<|begin_of_text|>",
                          eos_token="<|eot_id|>", pad_token=None, chat_template=LLAMA3_TEMPLATE)  # fmt: skip
    bos = tok.bos_token_id
    tok.backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]),
    ])  # fmt: skip
    hf = tiny_hf_model("llama", vocab_size=tok.vocab_size)
    folder = save_hf(hf, tmp_path_factory.mktemp("llama3"))
    tok.save(folder)
    return hf, AutoTokenizer.from_pretrained(folder), astrai.load(folder)


@pytest.fixture
def submitted(monkeypatch):
    """The prompt ids every engine request is submitted with."""
    seen = []
    original = Engine.submit

    def spy(self, prompt, *args, **kwargs):
        seen.append(list(prompt))
        return original(self, prompt, *args, **kwargs)

    monkeypatch.setattr(Engine, "submit", spy)
    return seen


def _hf_reply(hf, hf_tok, messages) -> str:
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    eos = hf_tok.convert_tokens_to_ids("<|eot_id|>")
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    return hf_tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_chat_equals_transformers_template_and_generate(pair):
    hf, hf_tok, model = pair
    expected = [_hf_reply(hf, hf_tok, m) for m in CONVERSATIONS]
    assert any(expected), "the random model replied with nothing: the comparison would be vacuous"
    assert astrai.chat(model, CONVERSATIONS[0], max_tokens=MAX_TOKENS) == expected[0]
    assert astrai.chat(model, CONVERSATIONS, max_tokens=MAX_TOKENS) == expected  # a batch: a list, in order


def test_chat_ids_hold_exactly_one_bos(pair, submitted):
    _, hf_tok, model = pair
    bos = model.tokenizer.bos_token_id
    astrai.chat(model, CONVERSATIONS[1], max_tokens=2)
    (ids,) = submitted
    reference = hf_tok.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True, tokenize=True)
    reference = reference["input_ids"] if not isinstance(reference, list) else reference
    assert ids == list(reference)
    assert ids[0] == bos and ids.count(bos) == 1
    # negative control: the naive path (render, then encode with the post-processor) has two
    text = model.tokenizer.apply_chat_template(CONVERSATIONS[1])
    assert model.tokenizer.encode(text)[:2] == [bos, bos]


def test_generate_on_rendered_template_text_adds_no_second_bos(pair, submitted):
    _, _, model = pair
    tok, bos = model.tokenizer, model.tokenizer.bos_token_id
    text = tok.apply_chat_template(CONVERSATIONS[0])
    assert text.startswith("<|begin_of_text|>")
    reply = astrai.chat(model, CONVERSATIONS[0], max_tokens=MAX_TOKENS)
    assert astrai.generate(model, text, max_tokens=MAX_TOKENS) == [reply]
    assert astrai.generate(model, [text], max_tokens=MAX_TOKENS, add_special_tokens=False) == [reply]
    assert submitted[1] == submitted[0] == submitted[2]
    assert submitted[1].count(bos) == 1
    # text without the BOS still gets one from the post-processor; add_special_tokens=False adds none
    assert tok.encode_prompt("hello world") == [bos, *tok.encode("hello world", add_special_tokens=False)]
    assert tok.encode_prompt("hello world", add_special_tokens=False)[0] != bos
    # negative control: the doubled-BOS ids the naive encoding gives change the reply on these weights
    doubled = tok.encode(text)
    assert doubled[:2] == [bos, bos]
    assert astrai.generate(model, [doubled], max_tokens=MAX_TOKENS) != [reply]


def test_chat_arguments(pair, submitted):
    _, _, model = pair
    assert isinstance(astrai.chat(model, CONVERSATIONS[0], max_tokens=2), str)
    # a whole template and template variables reach the rendering
    template = "{{ bos_token }}{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    astrai.chat(model, CONVERSATIONS[0], chat_template=template, chat_template_kwargs={"greeting": "hello world"},
                max_tokens=2)  # fmt: skip
    tok = model.tokenizer
    assert submitted[-1] == tok.encode("<|begin_of_text|>hello worldhello, how are you?", add_special_tokens=False)
    sampled = [astrai.chat(model, CONVERSATIONS[0], max_tokens=8, temperature=1.0, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]
    with pytest.raises(ValueError, match="non-empty list"):
        astrai.chat(model, [])
    with pytest.raises(ValueError, match="conversation 1"):
        astrai.chat(model, [CONVERSATIONS[0], []])
    with pytest.raises(ValueError, match="add_generation_prompt"):
        astrai.chat(model, CONVERSATIONS[0], chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(TypeError):
        astrai.chat(model, CONVERSATIONS[0], max_new_tokens=4)  # sampling typos are errors, not template kwargs


def test_engine_text_prompts_keep_one_bos(pair):
    # Engine.submit(text) encodes through Tokenizer.encode_prompt too (the engine, `astrai generate --prompt`)
    from astrai.inference.engine import EngineConfig
    from astrai.inference.params import SamplingParams

    _, _, model = pair
    text = model.tokenizer.apply_chat_template(CONVERSATIONS[0])
    config = EngineConfig(kv_budget_tokens=256, max_running=2, compile=False, background=False)
    with Engine(model, config) as engine:
        completion = engine.generate([text], SamplingParams(max_tokens=1))[0]
    assert completion.prompt_tokens == len(model.tokenizer.encode(text)) - 1
