"""The engine sampler against independent references: transformers' logits processors, OpenAI's penalty formula
in plain Python, exact filter definitions; plus draw statistics, seeded reproducibility, noise, logprobs and
one `torch.compile(fullgraph=True)` parity check."""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from astrai.inference.noise import exponential_noise
from astrai.inference.params import SamplingParams
from astrai.inference.sampler import penalize_logits, process_logits, sample
from astrai.inference.sampling_batch import make_sampling_batch
from astrai.tree import replace
from helpers import assert_close

P = SamplingParams


def _batch(params, vocab, *, seeds=None, steps=None, prompts=None, outputs=None, stop_ids=None):
    n = len(params)
    return make_sampling_batch(
        params,
        seeds=list(range(n)) if seeds is None else seeds,
        steps=[0] * n if steps is None else steps,
        vocab_size=vocab,
        device="cpu",
        prompts=prompts,
        outputs=outputs,
        stop_ids=stop_ids,
    )


def _reference_row(logits, p: SamplingParams, prompt, output, stop_ids, step):
    """One row through plain Python (bias, min_tokens, OpenAI penalties) and transformers' processors."""
    x = logits.clone().float()[None]  # [1, V]
    for token, bias in p.logit_bias:
        x[0, token] += bias
    if step < p.min_tokens:
        for token in {*stop_ids, *p.stop_token_ids}:
            x[0, token] = float("-inf")
    if p.repetition_penalty != 1 and (prompt or output):
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([list(prompt) + list(output)]), x)
    for token in set(output):  # OpenAI: mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence
        x[0, token] -= output.count(token) * p.frequency_penalty + p.presence_penalty
    if p.temperature == 0:
        return torch.full_like(x[0], float("-inf")).index_fill(0, x[0].argmax(), x[0].max())
    x = TemperatureLogitsWarper(p.temperature)(None, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(None, x)
    if p.top_p < 1:
        x = TopPLogitsWarper(p.top_p)(None, x)
    if p.min_p > 0:
        x = MinPLogitsWarper(p.min_p)(None, x)
    return x[0]


MIXED = [
    P(temperature=0.7, top_k=5),
    P(temperature=1.3, top_p=0.8),
    P(temperature=0.9, top_k=10, top_p=0.5, min_p=0.1),
    P(temperature=1.0, min_p=0.2),
    P(temperature=0.5, repetition_penalty=1.5, top_p=0.9),
    P(temperature=1.1, frequency_penalty=0.7, presence_penalty=-0.4),
    P(temperature=0.8, frequency_penalty=-1.0, repetition_penalty=0.8, top_k=-1),
    P(temperature=1.0, logit_bias={3: 5.0, 7: -100.0, 11: 2.5}, top_k=20),
    P(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.5),
    P(temperature=1.0, min_tokens=4, stop_token_ids=(9,)),
    P(),
]


def test_process_logits_matches_references_per_row():
    vocab, n = 64, len(MIXED)
    logits = torch.randn(n, vocab) * 3
    prompts = [torch.randint(0, vocab, (int(torch.randint(0, 12, ())),)).tolist() for _ in range(n)]
    outputs = [torch.randint(0, vocab, (int(torch.randint(0, 12, ())),)).tolist() for _ in range(n)]
    stop_ids, steps = [[0, 1]] * n, [len(o) for o in outputs]
    steps[9] = 2  # under min_tokens: ids 0, 1 (eos) and 9 (stop_token_ids) are masked
    batch = _batch(MIXED, vocab, prompts=prompts, outputs=outputs, stop_ids=stop_ids, steps=steps)
    ours = process_logits(logits, batch)
    for i, p in enumerate(MIXED):
        ref = _reference_row(logits[i], p, prompts[i], outputs[i], stop_ids[i], steps[i])
        assert torch.equal(ours[i].isinf(), ref.isinf()), f"row {i} ({p}) keeps a different set"
        kept = ~ref.isinf()
        assert_close(ours[i][kept], ref[kept], atol=1e-5, rtol=1e-5, msg=f"row {i}")
    assert ours[9, [0, 1, 9]].isinf().all()


def test_rows_past_min_tokens_and_ignore_eos_are_not_masked():
    vocab = 16
    logits = torch.zeros(3, vocab)
    params = [P(min_tokens=3), P(min_tokens=3), P(min_tokens=3, stop_token_ids=(5,))]
    batch = _batch(params, vocab, steps=[3, 2, 0], stop_ids=[[0], [0], []])  # row 2: ignore_eos -> no eos id
    masked = process_logits(logits, batch).isinf()
    assert not masked[0].any()
    assert masked[1].nonzero().flatten().tolist() == [0]
    assert masked[2].nonzero().flatten().tolist() == [5]
    # a huge stop logit is still never drawn while masked
    logits[:, 0] = 50.0
    drawn = sample(logits[:1].expand(64, -1), _batch([P(min_tokens=1)] * 64, vocab, stop_ids=[[0]] * 64)).tokens
    assert not drawn.eq(0).any()


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_minimal_set_reaching_p(p):
    logits = torch.randn(32, 100) * 2
    kept = ~process_logits(logits, _batch([P(top_p=p)] * 32, 100)).isinf()
    probs = logits.softmax(-1)
    for row in range(32):
        mass = probs[row][kept[row]].sum()
        smallest = probs[row][kept[row]].min()
        assert mass >= p - 1e-6, "kept mass below top_p"
        assert mass - smallest < p + 1e-6, "not minimal: dropping the least likely kept token still reaches p"
        dropped = probs[row][~kept[row]]
        assert dropped.numel() == 0 or dropped.max() <= smallest, "kept set is not the most likely tokens"


def test_top_p_boundary_mass_exactly_p_keeps_only_the_set_reaching_it():
    """Probabilities exactly [0.5, 0.25, 0.25] (logits [ln 2, 0, 0]; float32 softmax is exact here) with top_p =
    0.5: the first token alone reaches p, so the nucleus is {0} (by hand, and transformers' TopPLogitsWarper,
    which drops ascending cumulative mass <= 1 - p, agrees). Random logits never hit this boundary, so it is the
    one check that a `<=` in place of `<` (keep tokens whose preceding mass equals p) would fail."""
    logits = torch.tensor([[math.log(2.0), 0.0, 0.0]])
    assert logits.softmax(-1)[0].tolist() == [0.5, 0.25, 0.25]  # the premise: exact in float32
    kept = ~process_logits(logits, _batch([P(top_p=0.5)], 3)).isinf()
    reference = ~TopPLogitsWarper(0.5)(None, logits.clone()).isinf()
    assert kept[0].tolist() == [True, False, False] == reference[0].tolist()


def test_min_p_and_logit_bias_definitions():
    logits = torch.randn(4, 50) * 2
    batch = _batch([P(min_p=m, temperature=0.7) for m in (0.0, 0.05, 0.3, 1.0)], 50)
    kept = ~process_logits(logits, batch).isinf()
    probs = (logits / 0.7).softmax(-1)
    for row, m in enumerate((0.0, 0.05, 0.3, 1.0)):
        assert torch.equal(kept[row], probs[row] >= m * probs[row].max())
    bias = P(logit_bias=((2, 10.0), (40, -3.5)))
    out = process_logits(logits[:1], _batch([bias], 50))[0]
    expected = logits[0].clone()
    expected[2] += 10.0
    expected[40] -= 3.5
    assert_close(out, expected, atol=1e-6)


def test_greedy_rows_take_the_penalised_argmax_while_others_sample():
    vocab, n = 32, 40
    logits = torch.randn(1, vocab).expand(n, -1).clone()
    top = int(logits[0].argmax())
    # greedy rows with a repetition penalty on the raw argmax must move off it; sampled rows at high temperature
    params = [P(temperature=0.0, repetition_penalty=1e3) if i % 2 else P(temperature=5.0) for i in range(n)]
    batch = _batch(params, vocab, seeds=list(range(n)), prompts=[[top]] * n)
    tokens = sample(logits, batch).tokens
    expected = _reference_row(logits[0], params[1], [top], [], [], 0).argmax()
    assert tokens[1::2].eq(expected).all() and expected != top
    assert len(set(tokens[0::2].tolist())) > 5, "sampled rows should vary across seeds"


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical values at p = 1e-4 for df = 1..7 (fixed seeds make the test deterministic)
CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


@pytest.mark.parametrize("vary", ["seed", "step"])
def test_draw_follows_the_filtered_distribution(vary):
    vocab, n = 8, 20000
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0, 1.5, 0.0, -3.0, 2.2]])
    p = P(temperature=0.8, top_k=6, top_p=0.95, frequency_penalty=0.3)
    ids = list(range(n))
    seeds, steps = (ids, [7] * n) if vary == "seed" else ([123] * n, ids)
    batch = _batch([p] * n, vocab, seeds=seeds, steps=steps, outputs=[[1, 1]] * n)
    drawn = sample(logits.expand(n, -1), batch).tokens
    probs = _reference_row(logits[0], p, [], [1, 1], [], 0).softmax(-1)
    counts = torch.bincount(drawn, minlength=vocab).float()
    assert counts[probs == 0].sum() == 0, "drew a filtered token"
    support = probs > 0
    stat = _chi_square(counts[support], probs[support])
    assert stat < CHI2_CRIT[int(support.sum()) - 1], f"chi-square {stat:.1f}: counts {counts} vs {probs * n}"


def test_same_seed_and_step_give_the_same_token_whatever_the_batch():
    vocab = 500
    logits = torch.randn(6, vocab)
    params = [P(temperature=1.0), P(temperature=0.7, top_p=0.9), P(temperature=1.2, top_k=50), P(min_p=0.01),
              P(temperature=2.0, frequency_penalty=0.5), P(temperature=0.0)]  # fmt: skip
    seeds, steps = [11, 12, 13, 11, 2**40 + 3, -7], [0, 5, 5, 9, 1, 3]
    outputs = [[1, 2], [3], [], [4, 4], [5], []]
    a = sample(logits, _batch(params, vocab, seeds=seeds, steps=steps, outputs=outputs)).tokens
    # reversed order, interleaved with unrelated rows of other settings (different static flags too)
    order = [5, 4, 3, 2, 1, 0]
    extra = P(temperature=0.3, top_k=3, repetition_penalty=1.2)
    rows = [i for j in order for i in (j, None)]
    b_params = [params[i] if i is not None else extra for i in rows]
    b_logits = torch.stack([logits[i] if i is not None else torch.randn(vocab) for i in rows])
    b = sample(
        b_logits,
        _batch(b_params, vocab, seeds=[seeds[i] if i is not None else 99 for i in rows],
               steps=[steps[i] if i is not None else 0 for i in rows],
               outputs=[outputs[i] if i is not None else [7] for i in rows]),
    ).tokens  # fmt: skip
    assert b[0::2].tolist() == [a[i].item() for i in order]
    # and alone, one row at a time
    for i in range(6):
        alone = _batch([params[i]], vocab, seeds=[seeds[i]], steps=[steps[i]], outputs=[outputs[i]])
        assert sample(logits[i : i + 1], alone).tokens.item() == a[i].item()


def test_noise_is_exp1_and_depends_only_on_seed_and_step():
    seeds, steps = torch.tensor([0, 1, 0, 2**33, -5]), torch.tensor([0, 0, 1, 0, 2**40])
    noise = exponential_noise(seeds, steps, 40000)  # [5, V]
    assert noise.dtype == torch.float32 and noise.isfinite().all() and (noise > 0).all()
    flat = noise.flatten().double()
    n = flat.numel()
    assert abs(flat.mean() - 1) < 5 / math.sqrt(n) and abs(flat.var() - 1) < 15 / math.sqrt(n)
    for x in (0.05, 0.5, 1.0, 3.0, 6.0):  # tail function P(E > x) = exp(-x)
        q = math.exp(-x)
        assert abs(float((flat > x).double().mean()) - q) < 5 * math.sqrt(q * (1 - q) / n), f"P(E > {x})"
    # rows differ by seed (including its high 32 bits) and by step, and are uncorrelated
    corr = torch.corrcoef(noise.double())
    assert (corr - torch.eye(5, dtype=torch.double)).abs().max() < 0.03
    neighbours = torch.corrcoef(torch.stack([noise[0, :-1], noise[0, 1:]]).double())[0, 1]
    assert abs(neighbours) < 0.03
    # a row depends on nothing else
    again = exponential_noise(torch.tensor([-5, 7, 0]), torch.tensor([2**40, 3, 1]), 40000)
    assert torch.equal(again[0], noise[4]) and torch.equal(again[2], noise[2])


def test_logprobs_are_raw_and_top_logprobs_sorted():
    vocab, k = 40, 5
    logits = torch.randn(len(MIXED), vocab) * 2
    batch = _batch(MIXED, vocab, outputs=[[1, 2, 2]] * len(MIXED), prompts=[[3]] * len(MIXED))
    out = sample(logits, batch, top_logprobs=k)
    raw = logits.log_softmax(-1)
    assert_close(out.logprobs, raw.gather(-1, out.tokens[:, None])[:, 0], atol=1e-6)
    assert out.top_ids.shape == (len(MIXED), k) and out.top_logprobs.shape == (len(MIXED), k)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert_close(out.top_logprobs, raw.gather(-1, out.top_ids), atol=1e-6)
    assert torch.equal(out.top_ids[:, 0], logits.argmax(-1))
    assert_close(out.top_logprobs, raw.topk(k, dim=-1).values, atol=1e-6)
    assert torch.equal(sample(logits, batch, want_logprobs=True).tokens, out.tokens)
    only = sample(logits, batch, want_logprobs=True)
    assert only.logprobs is not None and only.top_ids is None and only.top_logprobs is None
    plain = sample(logits, batch)
    assert plain.logprobs is None and plain.top_ids is None


def test_make_sampling_batch_fields_and_flags():
    b = _batch([P(temperature=0), P(temperature=0, top_k=5)], 10)
    assert b.all_greedy and not b.needs_sort
    assert b.logit_bias is None and b.output_counts is None and b.prompt_mask is None and b.min_tokens_mask is None
    b = _batch([P(top_k=-1), P(top_k=10), P(top_k=3)], 10)
    assert b.top_k.tolist() == [0, 0, 3] and b.needs_sort and not b.all_greedy
    assert not _batch([P(top_k=10), P(min_p=0.5)], 10).needs_sort  # top_k >= V is off
    b = _batch([P(frequency_penalty=1.0), P()], 10, outputs=[[3, 3, 4], [5]], prompts=[[1], [2]])
    assert b.output_counts.dtype == torch.int32 and b.prompt_mask is None
    assert b.output_counts[0].tolist() == [0, 0, 0, 2, 1, 0, 0, 0, 0, 0] and b.output_counts[1, 5] == 1
    b = _batch([P(repetition_penalty=1.2)], 10, prompts=[[1, 1, 9]])
    assert b.prompt_mask.dtype == torch.bool and b.prompt_mask[0].nonzero().flatten().tolist() == [1, 9]
    assert _batch([P()], 10, seeds=[2**64 + 5]).seed.tolist() == [5]
    with pytest.raises(ValueError, match="outputs"):
        _batch([P(frequency_penalty=1.0)], 10, outputs=[[10]])
    with pytest.raises(ValueError, match="seeds"):
        make_sampling_batch([P()], seeds=[], steps=[0], vocab_size=10, device="cpu")


def test_penalties_skip_when_unused():
    logits = torch.randn(2, 20)
    assert torch.equal(penalize_logits(logits, _batch([P(), P(temperature=0)], 20)), logits)


def test_compiled_sample_matches_eager():
    vocab = 96
    logits = torch.randn(len(MIXED), vocab) * 2
    batch = _batch(
        MIXED, vocab, seeds=[3 * i for i in range(len(MIXED))], steps=list(range(len(MIXED))),
        prompts=[[1, 2]] * len(MIXED), outputs=[[2, 5, 5]] * len(MIXED), stop_ids=[[0]] * len(MIXED),
    )  # fmt: skip
    eager = sample(logits, batch, top_logprobs=3)
    compiled = torch.compile(sample, fullgraph=True)(logits, batch, top_logprobs=3)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert torch.equal(compiled.top_ids, eager.top_ids)
    assert_close(compiled.logprobs, eager.logprobs, atol=1e-5)
    assert_close(compiled.top_logprobs, eager.top_logprobs, atol=1e-5)


@pytest.mark.gpu
def test_noise_and_tokens_are_the_same_on_cuda():
    seeds, steps = torch.tensor([1, 2**35 + 1, -9]), torch.tensor([0, 4, 2**33])
    cpu = exponential_noise(seeds, steps, 5000)
    gpu = exponential_noise(seeds.cuda(), steps.cuda(), 5000).cpu()
    assert_close(gpu, cpu, atol=1e-6, rtol=1e-6)
    logits = torch.randn(len(MIXED), 300)
    batch = _batch(MIXED, 300, outputs=[[4]] * len(MIXED))
    on_gpu = make_sampling_batch(MIXED, seeds=list(range(len(MIXED))), steps=[0] * len(MIXED), vocab_size=300,
                                 device="cuda", outputs=[[4]] * len(MIXED))  # fmt: skip
    assert torch.equal(sample(logits.cuda(), on_gpu).tokens.cpu(), sample(logits, batch).tokens)


def _adversarial_case():
    """Rows whose settings or logits used to make NaN (issue 18); returns (logits, batch, raw-argmax fallback)."""
    vocab, nan, inf = 32, float("nan"), float("inf")
    logits = torch.randn(9, vocab) * 3
    logits[5, 7] = nan  # the model produced a NaN entry (sampled row)
    logits[6] = -inf  # nothing is possible: the defined answer is token 0
    logits[8, 2] = nan  # a NaN entry in a greedy row
    params = [P(temperature=1.0)] * 4 + [P(temperature=1.0, repetition_penalty=1.5)] + [P(temperature=1.0)] * 3
    params += [P(temperature=0.0)]
    top = int(logits[4].argmax())
    batch = _batch(params, vocab, seeds=list(range(9)), prompts=[[]] * 4 + [[top, 1]] + [[]] * 4)
    # values a client could send before validation existed, as float32 tensors: 1e-45 is subnormal, 5e-324 is 0
    temperature = torch.tensor([1e-45, 1e-39, 5e-324, nan, 1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float32)
    repetition = batch.repetition_penalty.clone()
    repetition[4] = 5e-324  # 0 in float32: the seen positive logits / 0 = +inf
    batch = replace(batch, temperature=temperature, repetition_penalty=repetition)
    return logits, batch, logits.masked_fill(logits.isnan(), -inf).argmax(-1)


def test_adversarial_rows_get_a_defined_token_never_argmax_of_nan():
    logits, batch, raw = _adversarial_case()
    out = sample(logits, batch, top_logprobs=1)
    # rows 0-2: tiny temperatures are greedy; 3-6, 8: no valid processed choice -> raw argmax (row 6: token 0)
    fallback = [0, 1, 2, 3, 4, 5, 6, 8]
    assert out.tokens[fallback].tolist() == raw[fallback].tolist() and out.tokens[6] == 0
    # greedy choices agree with their logprobs (the bug reported a top-1 that contradicted the choice)
    assert torch.equal(out.tokens[:3], out.top_ids[:3, 0]) and torch.equal(out.logprobs[:3], out.top_logprobs[:3, 0])
    # a healthy row in the same batch samples exactly as it does alone
    alone = make_sampling_batch([P(temperature=1.0)], seeds=[7], steps=[0], vocab_size=32, device="cpu")
    assert out.tokens[7] == sample(logits[7:8], alone).tokens[0]
    # process_logits keeps one token (the argmax) for the tiny-temperature rows
    kept = ~process_logits(logits[:3], replace(_batch([P()] * 3, 32), temperature=batch.temperature[:3])).isinf()
    assert kept.sum(-1).tolist() == [1, 1, 1] and torch.equal(kept.float().argmax(-1), raw[:3])


@pytest.mark.slow  # 30 s on 2 cores: one more compile of `sample`; the eager NaN policy tests stay in the CI set
def test_compiled_sample_keeps_the_nan_policy():
    logits, batch, raw = _adversarial_case()
    compiled = torch.compile(sample, fullgraph=True)
    assert torch.equal(compiled(logits, batch, want_logprobs=True).tokens, sample(logits, batch).tokens)
    # the all-greedy variant (no filters, no noise) falls back the same way: every row is its raw argmax
    assert torch.equal(compiled(logits, replace(batch, all_greedy=True)).tokens, raw)
