"""Named configs are valid and round-trip through transformers' config classes."""

import pytest
import transformers

from astrai.configs.models import NAMED
from astrai.io.hf import config_from_hf, config_to_hf
from astrai.models.config import check_config
from astrai.models.decoder import init_params_meta
from astrai.tree import count

# Published parameter counts (tied embeddings counted once).
PUBLISHED = {"smollm2-135m": 134_515_008, "qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_config_is_valid_and_round_trips(name):
    cfg = NAMED[name]()
    check_config(cfg)
    hf_cls = transformers.AutoConfig.for_model(cfg.model_type).__class__
    assert config_from_hf(hf_cls(**config_to_hf(cfg)).to_dict()) == cfg
    if name in PUBLISHED:
        assert count(init_params_meta(cfg)) == PUBLISHED[name]
