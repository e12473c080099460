"""One full `astrai quickstart` training run per test session, shared by test_run.py (its accuracy) and
test_rl.py (GRPO from it must gain): the run is the suite's most expensive fixture (~3.5 minutes on 2 cores)."""

import io

import attrs
import pytest
from rich.console import Console

from astrai.configs.models import chat_small
from astrai.quickstart.evaluate import EvalResult
from astrai.quickstart.run import QuickstartSettings, run_quickstart


@attrs.frozen
class TrainedQuickstart:
    settings: QuickstartSettings
    result: EvalResult
    text: str


@pytest.fixture(scope="session")
def trained_quickstart(tmp_path_factory) -> TrainedQuickstart:
    """`make run`'s quickstart (the default settings), scored on 200 of the 810 held-out problems."""
    settings = QuickstartSettings(out_dir=tmp_path_factory.mktemp("quickstart") / "qs", eval_size=200)
    out = io.StringIO()
    # the model config `astrai quickstart` resolves from the default `--model chat-small`
    result = run_quickstart(settings, Console(file=out, width=200), model_cfg=chat_small())
    return TrainedQuickstart(settings, result, out.getvalue())
