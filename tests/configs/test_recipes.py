"""Named training recipes: each builds a valid TrainConfig, survives the config.json round trip and parses flags."""

import pytest
import tyro

from astrai.configs.models import NAMED
from astrai.configs.recipes import RECIPES
from astrai.train.config import TrainConfig, config_from_dict, config_to_dict


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_round_trips_and_takes_overrides(name):
    cfg = RECIPES[name]()
    assert cfg.model in NAMED
    assert config_from_dict(config_to_dict(cfg)) == cfg
    changed = tyro.cli(TrainConfig, default=cfg, args=["--optim.lr", "0.125", "--steps", "7"])
    assert changed.optim.lr == 0.125 and changed.steps == 7 and changed.data == cfg.data


def test_bad_saved_config_names_the_field():
    data = config_to_dict(RECIPES["sft-tiny"]())
    data["optim"]["lr"] = "fast"
    with pytest.raises(ValueError, match="optim.lr"):
        config_from_dict(data)
    data = config_to_dict(RECIPES["sft-tiny"]())
    data["batch_size"] = 0
    with pytest.raises(ValueError, match="batch_size"):
        config_from_dict(data)


def test_lora_flags_override_a_lora_recipe():
    args = ["--lora.r", "8", "--lora.targets", "all-linear"]
    cfg = tyro.cli(TrainConfig, default=RECIPES["sft-lora-tiny"](), args=args, config=(tyro.conf.AvoidSubcommands,))
    assert cfg.lora.r == 8 and "gate_proj" in cfg.lora.target_names
