"""`astrai train`'s model names: the CLI resolves configs/models.py names to a ModelConfig for the loop."""

import pytest

from astrai.cli.main import main
from astrai.cli.train import resolve_model
from astrai.configs.models import NAMED, tiny


def test_named_models_resolve_to_their_config_and_folders_to_none(tmp_path):
    assert resolve_model("tiny") == tiny()
    assert all(resolve_model(name) == make() for name, make in NAMED.items())
    assert resolve_model(str(tmp_path)) is None  # a model folder: the loop loads it
    with pytest.raises(ValueError, match=r"'no-such-model' is neither a named config \(.*tiny.*\) nor a folder"):
        resolve_model("no-such-model")


def test_cli_names_unknown_models(capsys):
    with pytest.raises(SystemExit) as err:
        main(["train", "sft-tiny", "--model", "no-such-model"])
    assert err.value.code == 2 and "'no-such-model' is neither a named config" in capsys.readouterr().err
