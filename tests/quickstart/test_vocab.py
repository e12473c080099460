"""The quickstart tokenizer: one id per character, lossless on every problem text, and the saved folder loads in
transformers' AutoTokenizer with the same ids, chat rendering and special tokens as in astrai's Tokenizer."""

import json

import pytest

from astrai.io.templates import chatml_template
from astrai.io.tokenizer import Tokenizer
from astrai.quickstart.task import KINDS, make_problems, to_chat
from astrai.quickstart.vocab import ALPHABET, SPECIAL_TOKENS, VOCAB_SIZE, build_tokenizer, save_tokenizer

transformers = pytest.importorskip("transformers")

PROBLEMS = [p for kind in KINDS for p in make_problems(kind, 40, seed=11)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def ours(folder):
    return Tokenizer.from_dir(folder)


@pytest.fixture(scope="module")
def hf(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def test_vocab_layout():
    tok = build_tokenizer()
    assert VOCAB_SIZE == 100 == tok.vocab_size
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.special_token_ids == frozenset({0, 1, 2, 3})
    assert [tok.id_to_token(i) for i in range(4, VOCAB_SIZE)] == list(ALPHABET)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)


def test_every_problem_text_round_trips_one_token_per_character():
    tok = build_tokenizer()
    texts = [t for p in PROBLEMS for t in (p.question, p.answer)]
    texts += [tok.apply_chat_template(to_chat(p), add_generation_prompt=False) for p in PROBLEMS[::20]]
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        plain = text
        for special in SPECIAL_TOKENS:
            plain = plain.replace(special, "\0")  # each special token is a single id
        assert len(ids) == len(plain), text
        assert all(tok.id_to_token(i) == c for i, c in zip(ids, plain, strict=True) if c != "\0")


def test_unknown_characters_become_unk():
    tok = build_tokenizer()
    assert tok.encode("é\tx") == [3, 3, tok.token_to_id("x")]
    assert tok.decode(tok.encode("é x")) == " x"


def test_saved_files(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == chatml_template()
    assert (config["eos_token"], config["pad_token"], config["bos_token"]) == ("<|im_end|>", "<|endoftext|>", None)
    special_map = json.loads((folder / "special_tokens_map.json").read_text())
    assert special_map == {"eos_token": "<|im_end|>", "unk_token": "<|unk|>", "pad_token": "<|endoftext|>"}


def test_astrai_loads_the_folder(ours):
    assert ours.vocab_size == VOCAB_SIZE
    assert ours.eos_token_ids == (2,) and ours.pad_token_id == 0 and ours.bos_token_id is None
    assert ours.chat_template == chatml_template()
    text = PROBLEMS[0].question
    assert ours.encode(text) == build_tokenizer().encode(text)


def test_transformers_encodes_and_decodes_the_same(ours, hf):
    assert len(hf) == VOCAB_SIZE
    assert (hf.eos_token_id, hf.pad_token_id, hf.unk_token_id, hf.bos_token) == (2, 0, 3, None)
    texts = [t for p in PROBLEMS for t in (p.question, p.answer)] + ["<|im_start|>user\nhi é!<|im_end|>\n"]
    for text in texts:
        ids = ours.encode(text)
        assert hf.encode(text) == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids)  # HF defaults to False
        assert hf.decode(ids, skip_special_tokens=False) == ours.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("with_answer", [False, True])
def test_transformers_chat_template_gives_the_same_ids(ours, hf, with_answer):
    for problem in PROBLEMS[::7]:
        messages = to_chat(problem, with_answer=with_answer)
        kwargs = {"add_generation_prompt": not with_answer}
        text = ours.apply_chat_template(messages, **kwargs)
        assert hf.apply_chat_template(messages, tokenize=False, **kwargs) == text
        ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
        assert ours.apply_chat_template(messages, tokenize=True, **kwargs) == list(ref)
        if not with_answer:
            assert text.endswith("<|im_start|>assistant\n") and problem.question in text


def test_streaming_detokenizer_matches_decode(ours):
    prompt = ours.apply_chat_template(to_chat(PROBLEMS[0], with_answer=False), tokenize=True)
    answer = ours.encode(PROBLEMS[0].answer + "<|im_end|>")
    detok = ours.detokenizer(prompt_ids=prompt)
    streamed = "".join(detok.add(i) for i in answer) + detok.flush()
    assert streamed == PROBLEMS[0].answer == ours.decode(answer)
