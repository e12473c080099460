"""Prompt log-probs equal transformers' log-softmax on the same weights, chunked or not."""

import pytest
import torch

import astrai
from astrai.inference.score import prompt_logprobs
from helpers import save_hf, tiny_hf_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = tiny_hf_model("qwen3")
    return hf, astrai.load(save_hf(hf, tmp_path_factory.mktemp("m")))


@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_prompt_logprobs_match_transformers(pair, chunk_size):
    hf, model = pair
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (1, 2, 17)]
    scores = prompt_logprobs(model, prompts, top=3, chunk_size=chunk_size)
    for ids, got in zip(prompts, scores, strict=True):
        assert got.token_ids == tuple(ids) and got.logprobs[0] is None and got.top_logprobs[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)  # [T, V]
        expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)]
        assert torch.allclose(torch.tensor(got.logprobs[1:], dtype=torch.float32), expected, atol=1e-4)
        for t, alts in enumerate(got.top_logprobs[1:]):
            values, indices = ref[t].topk(3)
            assert [a for a, _ in alts] == indices.tolist()
            assert torch.allclose(torch.tensor([b for _, b in alts]), values, atol=1e-4)


def test_bad_prompts_are_named(pair):
    _, model = pair
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        prompt_logprobs(model, [[1], []])
    with pytest.raises(ValueError, match="outside"):
        prompt_logprobs(model, [[model.config.vocab_size]])
    assert prompt_logprobs(model, [[5, 6]])[0].top_logprobs == (None, ())
