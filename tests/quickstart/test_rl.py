"""`astrai quickstart --rl` (`astrai.quickstart.rl`): the RL task's splits, the CLI flag, and the whole pipeline
(SFT model -> accuracy before -> GRPO -> accuracy after) from the session's full quickstart model
(conftest.py's `trained_quickstart`, shared with test_run.py so the suite trains it once).

The pipeline test runs 6 GRPO steps at the default settings and asserts that the run happens and reports (the
probe, both accuracies, the table, the model, the metrics); it does not assert a gain, which 6 steps do not make.
The gains of the full 40-step default run, over several SFT models, are in docs/training.md ("RL quickstart").
"""

import io
import shutil

import pytest
import tyro
from rich.console import Console

from astrai.cli.quickstart import QuickstartConfig
from astrai.quickstart.rl import PARAPHRASES, RLSettings, pick_paraphrase, rl_problems, run_rl
from astrai.quickstart.run import QuickstartSettings
from astrai.quickstart.task import split_problems
from astrai.train.metrics import read_metrics

RL = RLSettings(steps=6, eval_size=100, samples=3)  # the defaults, shortened


def test_rl_problems_are_paraphrases_of_the_sft_split():
    sft_train, sft_test = split_problems("add2", seed=0)
    for template in PARAPHRASES:
        train, test = rl_problems(seed=0, template=template)
        assert len(train) == len(sft_train) and len(test) == len(sft_test)
        assert not {p.question for p in train} & {p.question for p in test}  # held out from RL as well
        for rl, sft in ((train[0], sft_train[0]), (test[-1], sft_test[-1])):
            a, b = sft.question.removeprefix("What is ").removesuffix("?").split(" + ")
            assert rl.question == template.format(a=a, b=b) and rl.answer == sft.answer == str(int(a) + int(b))
        assert not {p.question for p in train + test} & {p.question for p in sft_train + sft_test}  # never SFT's


def test_the_probe_picks_the_phrasing_nearest_40_percent_within_range():
    assert pick_paraphrase({"a": 0.84, "b": 0.31, "c": 0.52, "d": 0.05}) == "b"  # |0.31-0.4| < |0.52-0.4|
    assert pick_paraphrase({"a": 0.84, "b": 0.69, "c": 0.21}) == "c"  # 0.21 is nearer 0.4 than 0.69
    assert pick_paraphrase({"a": 0.95, "b": 0.10, "c": 0.74}) == "b"  # none in range: the nearest 40% (0.30)
    assert pick_paraphrase({"a": 0.10, "b": 0.70}) == "b"  # the only one in range, however far from 0.4


def test_cli_rl_flag_and_grpo_options():
    cfg = tyro.cli(QuickstartConfig, args=["--rl", "--grpo.steps", "5", "--grpo.lr", "3e-4", "--steps", "7",
                                           "--grpo.paraphrase", "Add {a} and {b}."])  # fmt: skip
    assert cfg.rl and cfg.grpo.steps == 5 and cfg.grpo.lr == 3e-4 and cfg.steps == 7
    assert cfg.grpo.paraphrase == "Add {a} and {b}." and cfg.grpo.probe_size == 100
    plain = tyro.cli(QuickstartConfig, args=[])
    assert not plain.rl and plain.grpo == RLSettings()


@pytest.mark.slow  # needs the full quickstart model (the session fixture: ~3.5 minutes on 2 cores)
def test_rl_from_the_quickstart_model_runs_and_reports(trained_quickstart, tmp_path):
    """GRPO on the paraphrased task from the full SFT model: both accuracies, the table, the model, the metrics."""
    shutil.copytree(trained_quickstart.settings.out_dir / "model", tmp_path / "qs" / "model")
    out = io.StringIO()
    result = run_rl(QuickstartSettings(out_dir=tmp_path / "qs"), RL, Console(file=out, width=200))
    text = out.getvalue()
    assert "training the SFT model first" not in text  # the saved SFT model is the starting point
    assert "probe: the SFT model" in text and "chosen" in text  # the phrasing was probed and picked
    assert f"accuracy before RL: {100 * result.before.accuracy:.1f}%" in text
    assert f"accuracy after RL: {100 * result.after.accuracy:.1f}%" in text
    assert "GRPO: 6 steps" in text and "rollout reward" in text and "before RL" in text  # the table's header
    assert result.before.n == result.after.n == RL.eval_size
    assert (result.model_dir / "config.json").is_file()
    rows = read_metrics(tmp_path / "qs" / "rl" / "train" / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(0 <= r["reward"] <= 1 for r in rows)
