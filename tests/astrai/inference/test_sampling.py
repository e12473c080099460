"""Sampling filters agree with transformers' logits warpers; the draw follows the filtered distribution."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from astrai.inference.sampling import SamplingTensors, filter_logits, sample, sampling_tensors


def _settings(temps, ks, ps):
    return SamplingTensors(
        temperature=torch.tensor(temps, dtype=torch.float32),
        top_k=torch.tensor(ks, dtype=torch.int64),
        top_p=torch.tensor(ps, dtype=torch.float32),
    )


@pytest.mark.parametrize(("temp", "k", "p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5)])
def test_filter_matches_transformers_warpers(temp, k, p):
    logits = torch.randn(4, 64) * 3
    ours = filter_logits(logits, _settings([temp] * 4, [k] * 4, [p] * 4))
    ref = TemperatureLogitsWarper(temp)(None, logits.clone())
    if k:
        ref = TopKLogitsWarper(k)(None, ref)
    if p < 1:
        ref = TopPLogitsWarper(p)(None, ref)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    kept = ~torch.isinf(ref)
    torch.testing.assert_close(ours[kept], ref[kept])


def test_per_row_settings_are_independent():
    logits = torch.randn(3, 32)
    s = _settings([1.0, 1.0, 1.0], [0, 3, 0], [1.0, 1.0, 0.3])
    out = filter_logits(logits, s)
    assert (~torch.isinf(out[0])).sum() == 32
    assert (~torch.isinf(out[1])).sum() == 3
    assert (~torch.isinf(out[2])).sum() < 32


def test_greedy_rows_take_argmax_and_draw_matches_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(20000, 1)
    s = sampling_tensors(20000, temperature=1.0)
    noise = torch.empty_like(logits).exponential_()
    drawn = sample(logits, s, noise)
    freq = torch.bincount(drawn, minlength=4).float() / drawn.numel()
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.01, rtol=0)
    greedy = sample(logits[:5], sampling_tensors(5), noise[:5])
    assert greedy.eq(2).all()
