"""Quickstart evaluation: exact-match scoring against an injected oracle generator (known right/wrong subsets),
batching and prompt rendering, and the default greedy path against a hand-written greedy loop over
`astrai.forward` on a tiny random model (also after a save/load round trip)."""

import attrs
import pytest
import torch

from astrai.api import forward
from astrai.configs.models import tiny
from astrai.io.model import Model, load, save
from astrai.models.decoder import init_params
from astrai.quickstart.evaluate import evaluate, extract_answer, render_prompt
from astrai.quickstart.task import KINDS, make_problems
from astrai.quickstart.vocab import build_tokenizer

PROBLEMS = [p for kind in KINDS for p in make_problems(kind, 4, seed=2)]  # 20 problems, 4 of each kind


@pytest.fixture(scope="module")
def model():
    tok = build_tokenizer()
    # a wide init makes the random logits peaked, so greedy choices are far from ties (checked below)
    cfg = attrs.evolve(tiny(tok.vocab_size), eos_token_id=(tok.eos_token_id,), initializer_range=0.5)
    return Model(config=cfg, params=init_params(cfg, seed=0), tokenizer=tok, eos_token_ids=(tok.eos_token_id,))


def _oracle(by_prompt: dict[str, str], calls: list):
    def generate_fn(prompts, max_tokens):
        calls.append((list(prompts), max_tokens))
        return [by_prompt[p] for p in prompts]

    return generate_fn


def test_scores_exact_matches_only(model):
    right = {0, 3, 4, 9, 10, 15, 19}  # indices answered correctly, in various harmless wrappings
    wrappings = ["{}", " {}\n", "{}<|im_end|>", "{}<|im_end|>junk", "{}<|endoftext|>"]
    near_misses = ["{}0", "x{}", "{}\n{}", "{} {}", "{}."]  # extra characters make an answer wrong
    completions = [
        (wrappings if i in right else near_misses)[i % 5].format(p.answer, p.answer) for i, p in enumerate(PROBLEMS)
    ]
    completions[8], completions[13] = PROBLEMS[8].answer[:-1], ""  # a prefix of the answer; nothing
    by_prompt = {render_prompt(model.tokenizer, p): c for p, c in zip(PROBLEMS, completions, strict=True)}
    calls = []
    result = evaluate(model, PROBLEMS, max_tokens=5, batch_size=6, generate_fn=_oracle(by_prompt, calls))
    assert (result.n, result.correct) == (20, 7)
    assert result.accuracy == pytest.approx(7 / 20)
    assert [i for i, s in enumerate(result.samples) if s.correct] == sorted(right)
    assert [s.problem for s in result.samples] == PROBLEMS
    assert result.samples[3].prediction == PROBLEMS[3].answer
    assert result.summary == "accuracy: 35.0% (7/20)"
    by_kind = result.by_kind()  # kinds are in blocks of 4: add2 = 0..3, add3 = 4..7, ...
    assert by_kind == {"add2": 0.5, "add3": 0.25, "reverse": 0.5, "upper": 0.25, "count": 0.25}
    # batches of at most 6, in order, each prompt a rendered chat ending in the assistant header
    assert [len(prompts) for prompts, _ in calls] == [6, 6, 6, 2] and {m for _, m in calls} == {5}
    flat = [p for prompts, _ in calls for p in prompts]
    assert flat == [render_prompt(model.tokenizer, p) for p in PROBLEMS]
    for prompt, problem in zip(flat, PROBLEMS, strict=True):
        assert prompt.endswith(f"<|im_start|>user\n{problem.question}<|im_end|>\n<|im_start|>assistant\n")


def test_all_right_and_all_wrong(model):
    by_prompt = {render_prompt(model.tokenizer, p): p.answer for p in PROBLEMS}
    assert evaluate(model, PROBLEMS, generate_fn=_oracle(by_prompt, [])).accuracy == 1.0
    wrong = {k: v + "1" for k, v in by_prompt.items()}
    assert evaluate(model, PROBLEMS, generate_fn=_oracle(wrong, [])).correct == 0


def test_extract_answer():
    assert extract_answer("  132 <|im_end|>\n<|im_start|>user") == "132"
    assert extract_answer("tac") == "tac"
    assert extract_answer("1\n2") == "1\n2"


def test_bad_inputs(model):
    with pytest.raises(ValueError, match="no problems"):
        evaluate(model, [])
    with pytest.raises(ValueError, match="returned 1 completions for 2 prompts"):
        evaluate(model, PROBLEMS[:2], generate_fn=lambda prompts, n: ["1"])


def _reference_greedy(model: Model, prompt: str, max_tokens: int) -> tuple[str, float]:
    """Greedy decoding by full forwards (no cache, no engine); also the smallest top-1/top-2 logit gap seen."""
    tok = model.tokenizer
    ids, out, gap = tok.encode(prompt), [], float("inf")
    for _ in range(max_tokens):
        logits = forward(model, torch.tensor([ids + out]))[0, -1]
        top = logits.topk(2).values
        gap = min(gap, float(top[0] - top[1]))
        token = int(logits.argmax())
        if token in model.eos_token_ids:
            break
        out.append(token)
    return extract_answer(tok.decode(out)), gap


def test_default_generation_is_greedy_on_the_chat_prompt(model, tmp_path):
    problems = PROBLEMS[::2]
    result = evaluate(model, problems, max_tokens=8, batch_size=4)
    refs = [_reference_greedy(model, render_prompt(model.tokenizer, p), 8) for p in problems]
    assert min(gap for _, gap in refs) > 1e-3  # the comparison is meaningful: no near-ties in the argmax
    assert [s.prediction for s in result.samples] == [text for text, _ in refs]
    assert any(len(text) < 8 for text, _ in refs)  # some completions ended at eos, not at max_tokens
    assert result.n == 10 and result.accuracy <= 0.1  # random weights
    reloaded = load(save(model, tmp_path / "m"))
    assert evaluate(reloaded, problems, max_tokens=8, batch_size=10).samples == result.samples
