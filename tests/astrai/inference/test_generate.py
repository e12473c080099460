"""Greedy generation equals transformers' greedy `generate`; sampling is reproducible; bad input is named."""

import pytest
import torch

from astrai.inference.generate import generate_ids
from astrai.io.model import load
from helpers import save_hf, tiny_hf_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = tiny_hf_model("qwen2", pad_token_id=0)
    return hf, load(save_hf(hf, tmp_path_factory.mktemp("m")))


def test_greedy_batch_equals_transformers(pair):
    hf, model = pair
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (4, 17, 9, 1)]
    ours = generate_ids(model, prompts, max_tokens=32, stop_token_ids=[])
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert [r[width:].tolist() for r in ref] == ours


def test_stops_at_eos_and_excludes_it(pair):
    _, model = pair
    prompt = [5, 6, 7]
    free = generate_ids(model, [prompt], max_tokens=12, stop_token_ids=[])[0]
    eos = free[4]
    stopped = generate_ids(model, [prompt], max_tokens=12, stop_token_ids=[eos])[0]
    assert stopped == free[: free.index(eos)]


def test_sampling_reproducible_with_seed(pair):
    _, model = pair
    kw = dict(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, stop_token_ids=[])
    a = generate_ids(model, [[1, 2, 3], [4]], seed=7, **kw)
    b = generate_ids(model, [[1, 2, 3], [4]], seed=7, **kw)
    c = generate_ids(model, [[1, 2, 3], [4]], seed=8, **kw)
    assert a == b and a != c


@pytest.mark.parametrize(
    ("prompts", "kwargs", "message"),
    [
        (
            [[1] * 250],
            {"max_tokens": 10},
            "250 tokens and max_tokens is 10: 260 tokens, more than the model's context of 256",
        ),
        ([[]], {}, "empty"),
        ([[1, 999]], {}, "outside \\[0, 256\\)"),
        ([[1]], {"max_tokens": 0}, "max_tokens"),
        ([[1]], {"temperature": -1.0}, "temperature"),
        ([[1]], {"top_p": 0.0}, "top_p"),
    ],
)
def test_bad_input_is_named(pair, prompts, kwargs, message):
    _, model = pair
    with pytest.raises(ValueError, match=message):
        generate_ids(model, prompts, **kwargs)
