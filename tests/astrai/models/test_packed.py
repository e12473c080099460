"""Packed training rows: document-aware attention, input embeddings and activation checkpointing."""

import pytest
import torch

from astrai.configs.models import tiny
from astrai.data.batch import document_ids
from astrai.models.decoder import hidden_states, init_params
from astrai.nn.embedding import embed
from astrai.tree import replace
from helpers import assert_close


@pytest.fixture(scope="module")
def model():
    cfg = tiny(vocab_size=97)
    return cfg, init_params(cfg, seed=3)


def test_document_ids_restart_at_position_zero():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 0, 1, 2]])
    assert document_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 2, 3, 3, 3]]


def test_packed_row_equals_separate_documents(model):
    cfg, params = model
    docs = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 3)]
    row = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    packed = hidden_states(params, cfg, row, positions=positions)  # leaks across documents
    packed_doc = hidden_states(params, cfg, row, positions=positions, doc_ids=document_ids(positions))
    start = 0
    for doc in docs:
        alone = hidden_states(params, cfg, doc[None])
        assert_close(packed_doc[:, start : start + len(doc)], alone, atol=1e-5)
        start += len(doc)
    # without the document mask the later documents see the earlier ones (so the test above can fail)
    later = hidden_states(params, cfg, docs[1][None])
    assert (packed[:, 5:14] - later).abs().max() > 1e-3


def test_embeds_and_checkpointed_blocks_match_the_plain_forward(model):
    cfg, params = model
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    plain = hidden_states(params, cfg, tokens)
    via_embeds = hidden_states(params, cfg, tokens, embeds=embed(params.embed_tokens, tokens))
    assert torch.equal(plain, via_embeds)
    leaf = params.blocks[0].mlp.up_proj.weight.detach().requires_grad_(True)
    grads = []
    mlp = replace(params.blocks[0].mlp, up_proj=replace(params.blocks[0].mlp.up_proj, weight=leaf))
    p = replace(params, blocks=(replace(params.blocks[0], mlp=mlp), *params.blocks[1:]))
    for ckpt in (False, True):
        out = hidden_states(p, cfg, tokens, checkpoint_blocks=ckpt)
        assert_close(out, plain, atol=1e-6)
        (g,) = torch.autograd.grad(out.square().sum(), leaf)
        grads.append(g)
    assert_close(grads[1], grads[0], atol=1e-5)
