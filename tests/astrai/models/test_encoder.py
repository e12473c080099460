"""Embedding encoder: bidirectional blocks vs transformers with an explicit non-causal mask, pooling vs plain
loops, padding invariance, the key-padding attention op vs a hand-written softmax, and `astrai.embed`."""

import attrs
import pytest
import torch

import astrai
from astrai.io.model import load
from astrai.models.decoder import forward
from astrai.models.encoder import EncoderConfig, encode, pool, token_states
from astrai.ops.attention import dense_attention
from helpers import assert_close, save_hf, tiny_hf_model, tiny_model_dir

LENGTHS = (9, 5, 1)


def _padded(vocab: int, lengths=LENGTHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random right-padded rows: pad positions hold random (not zero) ids, so they would show if attended."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    return tokens, mask


def _pool_ref(states: torch.Tensor, lengths, pooling: str, normalize: bool) -> torch.Tensor:
    rows = []
    for b, n in enumerate(lengths):
        real = states[b, :n].double()
        v = {"mean": real.mean(0) if n else torch.zeros_like(states[b, 0], dtype=torch.float64),
             "cls": states[b, 0].double(), "last": real[-1] if n else states[b, 0].double()}[pooling]  # fmt: skip
        rows.append(v / v.norm() if normalize and v.norm() > 0 else v)
    return torch.stack(rows)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
@pytest.mark.parametrize("normalize", [False, True])
def test_pool_matches_loops(pooling, normalize):
    lengths = (6, 3, 1, 0)
    states = torch.randn(len(lengths), 6, 8)
    mask = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    got = pool(states, mask, EncoderConfig(pooling=pooling, normalize=normalize))
    assert got.dtype == torch.float32 and got.isfinite().all()
    assert_close(got, _pool_ref(states, lengths, pooling, normalize), atol=1e-6)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def hf_and_model(request, tmp_path_factory):
    hf = tiny_hf_model(request.param)
    return hf, load(save_hf(hf, tmp_path_factory.mktemp(request.param)))


def test_bidirectional_states_match_transformers_with_non_causal_mask(hf_and_model):
    hf, model = hf_and_model
    tokens, mask = _padded(hf.config.vocab_size)
    # an additive [B, 1, T, S] float mask: every real key, no causality (transformers 5.24 uses a 4-D mask as is)
    hidden = ~mask[:, None, None, :].expand(-1, 1, tokens.shape[1], -1)
    four_d = torch.zeros(hidden.shape).masked_fill(hidden, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = hf.model(tokens, attention_mask=four_d).last_hidden_state  # final norm included
    states = token_states(model.params, model.config, tokens, mask)
    for b, n in enumerate(LENGTHS):
        assert_close(states[b, :n], expected[b, :n], atol=1e-4, msg=f"row {b}")
    for pooling in ("mean", "cls", "last"):
        got = encode(model.params, model.config, tokens, mask, enc=EncoderConfig(pooling=pooling, normalize=True))
        assert_close(got, _pool_ref(expected, LENGTHS, pooling, True), atol=1e-5, msg=pooling)


def test_causal_without_padding_matches_decoder_and_transformers(hf_and_model):
    hf, model = hf_and_model
    tokens = torch.randint(0, hf.config.vocab_size, (2, 8))
    states = token_states(model.params, model.config, tokens, causal=True)
    with torch.no_grad():
        expected = hf.model(tokens).last_hidden_state
    assert_close(states, expected, atol=1e-4)
    logits = forward(model.params, model.config, tokens)  # the decoder's own path, LM head applied
    assert_close(states @ model.params.lm_head.weight.T, logits, atol=1e-4)


def test_first_token_sees_later_tokens(hf_and_model):
    _, model = hf_and_model
    tokens = torch.randint(0, 200, (1, 7))
    changed = tokens.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 200
    bi = [token_states(model.params, model.config, t) for t in (tokens, changed)]
    causal = [token_states(model.params, model.config, t, causal=True) for t in (tokens, changed)]
    assert (bi[0][0, 0] - bi[1][0, 0]).abs().max() > 1e-3  # bidirectional: position 0 depends on position 5
    assert_close(causal[0][0, :5], causal[1][0, :5], atol=1e-6)  # causal: positions before 5 do not


def test_padding_changes_nothing(hf_and_model):
    _, model = hf_and_model
    alone = torch.randint(0, 200, (1, 4))
    padded, mask = _padded(200, lengths=(4, 9), seed=3)
    padded[0, :4] = alone[0]
    ref = token_states(model.params, model.config, alone)[0]
    assert_close(token_states(model.params, model.config, padded, mask)[0, :4], ref, atol=1e-5)
    for pooling in ("mean", "cls", "last"):
        enc = EncoderConfig(pooling=pooling, normalize=False)
        one = encode(model.params, model.config, alone, enc=enc)
        assert_close(encode(model.params, model.config, padded, mask, enc=enc)[:1], one, atol=1e-5, msg=pooling)


def _attention_ref(q, k, v, scale, causal, key_mask):
    """Plain softmax attention, one (batch, head) at a time; a query with no visible key gets zeros."""
    out = torch.zeros_like(q, dtype=torch.float64)
    rep = q.shape[2] // k.shape[2]
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            scores = (q[b, :, h].double() @ k[b, :, h // rep].double().T) * scale  # [T, S]
            allowed = key_mask[b][None, :].expand_as(scores).clone()
            if causal:
                allowed &= torch.ones_like(allowed).tril().bool()
            for i in range(scores.shape[0]):
                if allowed[i].any():
                    w = torch.softmax(scores[i].masked_fill(~allowed[i], float("-inf")), -1)
                    out[b, i, h] = w @ v[b, :, h // rep].double()
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_dense_attention_key_padding_vs_softmax_loop(causal):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 6, 4, 8), torch.randn(3, 6, 2, 8), torch.randn(3, 6, 2, 8)
    key_mask = torch.arange(6)[None, :] < torch.tensor([6, 2, 0])[:, None]  # the last row is all padding
    got = dense_attention(q, k, v, scale=0.3, causal=causal, key_padding_mask=key_mask)
    assert got.isfinite().all(), "a fully padded row must not produce NaN"
    ref = _attention_ref(q, k, v, 0.3, causal, key_mask)
    for b, n in enumerate((6, 2)):
        assert_close(got[b, :n], ref[b, :n], atol=1e-5, msg=f"row {b}")
    everything = _attention_ref(q[2:], k[2:], v[2:], 0.3, False, torch.ones(1, 6, dtype=torch.bool))
    assert_close(got[2:], everything, atol=1e-5, msg="all-padding row attends to every key (documented fallback)")
    if not causal:  # no mask at all: the fast path, bidirectional
        assert_close(dense_attention(q, k, v, scale=0.3, causal=False), _attention_ref(q, k, v, 0.3, False,
                     torch.ones(3, 6, dtype=torch.bool)), atol=1e-5)  # fmt: skip


def test_bad_inputs_are_named(text_model):
    with pytest.raises(ValueError, match="pooling"):
        EncoderConfig(pooling="max")
    model = text_model
    tokens = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="pad on the right"):
        encode(model.params, model.config, tokens, torch.tensor([[0, 1, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask shape"):
        encode(model.params, model.config, tokens, torch.ones(2, 4))


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return astrai.load(tiny_model_dir(tmp_path_factory.mktemp("embed") / "m"))


def test_embed_texts_equals_encode_one_by_one(text_model):
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "fox", "hello"]
    got = astrai.embed(text_model, texts, pooling="last", normalize=True, batch_size=3)
    assert got.shape == (4, text_model.config.hidden_size) and got.dtype == torch.float32
    enc = EncoderConfig(pooling="last", normalize=True)
    for i, text in enumerate(texts):
        ids = torch.tensor([text_model.tokenizer.encode(text)])
        assert_close(got[i], encode(text_model.params, text_model.config, ids, enc=enc)[0], atol=1e-5, msg=text)
    assert_close(got.norm(dim=-1), torch.ones(4), atol=1e-5)
    assert_close(astrai.embed(text_model, texts, pooling="last", batch_size=32), got, atol=1e-5)
    mean = astrai.embed(text_model, "hello world", normalize=False)
    assert mean.shape == (1, text_model.config.hidden_size) and mean.norm() != pytest.approx(1.0)


def test_embed_errors(text_model):
    with pytest.raises(ValueError, match="no tokenizer"):
        astrai.embed(attrs.evolve(text_model, tokenizer=None), ["x"])
    with pytest.raises(ValueError, match="input 1 is empty"):
        astrai.embed_ids(text_model, [[1, 2], []])
    with pytest.raises(ValueError, match="outside"):
        astrai.embed_ids(text_model, [[text_model.config.vocab_size]])
    with pytest.raises(TypeError, match=r"texts\[0\]"):
        astrai.embed(text_model, [3])
