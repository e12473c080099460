"""Speculative decoding's pieces (issue 43): the config (vLLM's JSON), the n-gram proposer against a brute-force
reference, adaptive draft lengths, and the two verifiers.

The rejection sampler's central claim, that the output has the target's distribution, is checked the way the
issue asks: a small vocabulary, a Markov-chain target and draft (so each position's distribution depends on the
guesses before it, as a model's does), k = 1..4, 10^5 sequences of three tokens; the empirical joint law is
compared with the exact one by total variation, which shrinks with samples and stays far below the distance to
other random chains (negative control). Temperature and top-p are applied to the target's logits by a plain numpy
reference before the sampler sees them.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from astrai.inference.speculative import (
    AdaptiveK,
    SpeculativeConfig,
    coupled_accept,
    propose_ngram,
    rejection_sample,
)

# ---- config -------------------------------------------------------------------------------------------------------


def test_vllm_json_forms_parse():
    ngram = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (ngram.method, ngram.num_speculative_tokens, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (
        "ngram", 4, 3, 3)  # fmt: skip
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    draft = SpeculativeConfig.parse({"model": "drafts/tiny", "num_speculative_tokens": 3})
    assert (draft.method, draft.draft_model) == ("draft", "drafts/tiny")
    spelt = SpeculativeConfig.parse({"method": "draft_model", "model": "d", "num_speculative_tokens": 1})
    assert spelt.method == "draft"
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    paused = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4})
    assert paused.disable_by_batch_size == 4 and ngram.disable_by_batch_size is None


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "eagle9", "num_speculative_tokens": 2}, "method must be one of"),
        ({"num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key(s) ['typo']"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "prompt_lookup_min (4) is greater"),
        ({"method": "draft", "num_speculative_tokens": 2}, 'needs "model"'),
        ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "ngram needs no model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
         "disable_by_batch_size must be >= 2"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "4"},
         "disable_by_batch_size must be an integer"),
    ],
)  # fmt: skip
def test_bad_configs_are_one_clear_error(value, names):
    with pytest.raises(ValueError) as err:
        SpeculativeConfig.parse(value)
    assert names in str(err.value)


# ---- n-gram proposer ----------------------------------------------------------------------------------------------


def _reference_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Brute force: for n from n_max down, every earlier match; the latest with k tokens after it, else the one
    with the most tokens after it."""
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tail]
        if starts:
            full = [s for s in starts if s + n + k <= len(tokens)]
            start = full[-1] if full else starts[0]
            return tokens[start + n : start + n + k]
    return []


def test_ngram_matches_the_brute_force_reference():
    rng = random.Random(0)
    found = 0
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        k, n_min = rng.randint(1, 5), rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        got = propose_ngram(tokens, k, n_min, n_max)
        assert got == _reference_ngram(tokens, k, n_min, n_max), (tokens, k, n_min, n_max)
        found += bool(got)
    assert found > 1000  # not vacuous: most random strings over 4 symbols have a match
    for _ in range(300):  # long sequences and wide lookups (the edit benchmark's 2..16), where matches grow long
        tokens = [rng.randrange(3) for _ in range(rng.randint(20, 200))]
        k, n_min, n_max = rng.randint(1, 8), rng.randint(1, 4), rng.randint(4, 16)
        assert propose_ngram(tokens, k, n_min, n_max) == _reference_ngram(tokens, k, n_min, n_max)


def test_ngram_prefers_the_longest_n_then_the_latest_match():
    #        a  b  c  X  b  c  Y  a  b  c
    tokens = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [9, 2]  # the 3-gram "a b c" matched at 0, though "b c" matched later
    assert propose_ngram(tokens, 2, 1, 2) == [8, 1]  # the 2-gram "b c": its latest match (at 4)
    assert propose_ngram([5, 6, 7], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([4, 4], 3, 1, 1) == [4]  # as many as there are
    assert propose_ngram([4] * 8, 3, 1, 3) == [4, 4, 4]  # a repeat: an earlier match gives k tokens, the latest one
    assert propose_ngram([1, 2, 3, 1, 2, 3, 9, 1, 2], 2, 2, 2) == [3, 9]  # the latest match with k tokens after it


# ---- adaptive k ---------------------------------------------------------------------------------------------------


def test_adaptive_k_shrinks_to_probes_backs_off_and_grows_back():
    policy = AdaptiveK(k_max=4)
    assert policy.next_k() == 4
    probes = []
    for round_ in range(400):  # every guess rejected
        k = policy.next_k()
        if k and policy.rate < policy.floor:
            probes.append(round_)
        policy.update(k, 0)
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:4] == [16, 32, 64, 128] and set(gaps[4:]) == {128}, probes  # doubling, then capped
    for _ in range(140):  # then everything passes: the next probe notices, and k climbs back
        k = policy.next_k()
        policy.update(k, k)
    assert policy.next_k() == 4 and policy._interval == 0


# ---- verifiers ----------------------------------------------------------------------------------------------------


def test_coupled_accept_is_the_length_of_the_matching_prefix():
    gen = torch.Generator().manual_seed(0)
    draft = torch.randint(0, 3, (500, 4), generator=gen)
    sampled = torch.randint(0, 3, (500, 5), generator=gen)
    num = torch.randint(0, 5, (500,), generator=gen)
    got = coupled_accept(draft, sampled, num)
    for row in range(500):
        expected = 0
        while expected < num[row] and draft[row, expected] == sampled[row, expected]:
            expected += 1
        assert got[row] == expected


V, LENGTH, START = 5, 3, 0


def _process(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Temperature then top-p (the smallest set whose mass reaches p) per row: the plain reference."""
    z = logits / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = np.zeros_like(p)
    for row in range(p.shape[0]):
        order = np.argsort(-p[row])
        mass = np.cumsum(p[row, order])
        keep = order[: int(np.searchsorted(mass, top_p) + 1)]
        out[row, keep] = p[row, keep] / p[row, keep].sum()
    return out


def _chain(seed: int, temperature: float = 1.0, top_p: float = 1.0) -> np.ndarray:
    """A random Markov chain over V tokens: row t is the distribution after token t."""
    return _process(np.random.default_rng(seed).normal(size=(V, V)) * 1.5, temperature, top_p)


def _joint(chain: np.ndarray) -> np.ndarray:
    """Exact law of the first LENGTH tokens after START, flattened over V^LENGTH."""
    out = np.zeros([V] * LENGTH)
    for seq in itertools.product(range(V), repeat=LENGTH):
        prob, prev = 1.0, START
        for t in seq:
            prob, prev = prob * chain[prev, t], t
        out[seq] = prob
    return out.reshape(-1)


def _speculate(target: np.ndarray, draft: np.ndarray, k: int, samples: int, seed: int = 0) -> np.ndarray:
    """LENGTH tokens per row from rounds of k draft guesses verified by `rejection_sample`; the empirical law."""
    p_table, q_table = torch.tensor(target, dtype=torch.float32), torch.tensor(draft, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((samples, LENGTH), -1, dtype=torch.int64)
    length = torch.zeros(samples, dtype=torch.int64)
    seeds = torch.arange(samples, dtype=torch.int64) + seed * samples
    rows = torch.arange(samples)
    while bool((length < LENGTH).any()):
        prev = torch.where(length > 0, out[rows, (length - 1).clamp(min=0)], START)
        guesses, q_rows, p_rows, context = [], [], [], prev
        for _ in range(k):  # the draft's own sampled guesses
            q = q_table[context]
            guess = torch.multinomial(q, 1, generator=gen).squeeze(-1)
            guesses.append(guess)
            q_rows.append(q)
            p_rows.append(p_table[context])
            context = guess
        p_rows.append(p_table[context])  # the bonus position
        accepted, tokens = rejection_sample(torch.stack(p_rows, 1), torch.stack(q_rows, 1), torch.stack(guesses, 1),
                                            seeds, length)  # fmt: skip
        for i in range(k + 1):
            write = (i <= accepted) & (length + i < LENGTH)
            out[rows[write], (length + i)[write]] = tokens[write, i]
        length = (length + accepted + 1).clamp(max=LENGTH)
        seeds = seeds + 7919 * samples  # each round draws fresh noise (the step advances too)
    index = (out * torch.tensor([V**2, V, 1])).sum(dim=1)
    return np.bincount(index.numpy(), minlength=V**LENGTH) / samples


def _tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_rejection_sampling_keeps_the_targets_distribution(k, temperature, top_p):
    target, draft = _chain(1, temperature, top_p), _chain(2)
    exact = _joint(target)
    small, large = _tv(_speculate(target, draft, k, 10_000), exact), _tv(_speculate(target, draft, k, 100_000), exact)
    assert large < 0.03 and large < small, (small, large)
    others = [_tv(_joint(_chain(seed, temperature, top_p)), exact) for seed in range(10, 15)]
    assert min(others) > 5 * large, (others, large)  # negative control: other chains are far away
    assert _tv(_joint(draft), exact) > 5 * large  # and so is the draft's own law (the guesses alone)


def test_rejection_sampling_is_seeded():
    target, draft = torch.tensor(_chain(1)), torch.tensor(_chain(2))
    p = target[[0, 1, 2]].float()[None].expand(64, 3, V)
    q = draft[[0, 1]].float()[None].expand(64, 2, V)
    guesses = torch.tensor([[1, 2]]).expand(64, 2)
    steps = torch.zeros(64, dtype=torch.int64)
    a1, t1 = rejection_sample(p, q, guesses, torch.arange(64), steps)
    a2, t2 = rejection_sample(p, q, guesses, torch.arange(64), steps)
    a3, t3 = rejection_sample(p, q, guesses, torch.arange(64) + 1000, steps)
    assert torch.equal(a1, a2) and torch.equal(t1, t2)
    assert not (torch.equal(a1, a3) and torch.equal(t1, t3))
