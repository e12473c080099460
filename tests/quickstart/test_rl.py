"""`astrai quickstart --rl` (`astrai.quickstart.rl`): the RL task's splits, the CLI flag, and the whole pipeline
(SFT model -> accuracy before -> GRPO -> accuracy after) from the session's full quickstart model
(conftest.py's `trained_quickstart`, shared with test_run.py so the suite trains it once).

The reduced GRPO stage (12 steps of 8 prompts x 8 samples at lr 1e-4, 200 held-out problems, ~30 s) must gain
at least 15 points: from the 800-step model it gained +44 to +58 points over three seeds. The full-size numbers
(35.6% -> 99.8% on 810 held-out problems with the defaults) are in docs/training.md ("RL quickstart").
"""

import io
import shutil

import tyro
from rich.console import Console

from astrai.cli.quickstart import QuickstartConfig
from astrai.quickstart.rl import PARAPHRASES, RLSettings, rl_problems, run_rl
from astrai.quickstart.run import QuickstartSettings
from astrai.quickstart.task import split_problems
from astrai.train.metrics import read_metrics

RL = RLSettings(steps=12, batch_size=8, num_generations=8, lr=1e-4, eval_size=200, samples=3)


def test_rl_problems_are_paraphrases_of_the_sft_split():
    train, test = rl_problems(seed=0)
    sft_train, sft_test = split_problems("add2", seed=0)
    assert len(train) == len(sft_train) and len(test) == len(sft_test)
    assert not {p.question for p in train} & {p.question for p in test}  # held out from RL as well
    for rl, sft in ((train[0], sft_train[0]), (test[-1], sft_test[-1])):
        a, b = sft.question.removeprefix("What is ").removesuffix("?").split(" + ")
        assert rl.question == PARAPHRASES[0].format(a=a, b=b) and rl.answer == sft.answer == str(int(a) + int(b))
    assert all(not p.question.startswith("What is ") for p in train + test)  # never the SFT phrasing


def test_cli_rl_flag_and_grpo_options():
    cfg = tyro.cli(QuickstartConfig, args=["--rl", "--grpo.steps", "5", "--grpo.lr", "3e-4", "--steps", "7"])
    assert cfg.rl and cfg.grpo.steps == 5 and cfg.grpo.lr == 3e-4 and cfg.steps == 7
    plain = tyro.cli(QuickstartConfig, args=[])
    assert not plain.rl and plain.grpo == RLSettings()


def test_rl_from_the_quickstart_model_gains_15_points(trained_quickstart, tmp_path):
    """GRPO on the paraphrased task from the full SFT model: reports both accuracies and gains >= 15 points."""
    shutil.copytree(trained_quickstart.settings.out_dir / "model", tmp_path / "qs" / "model")
    out = io.StringIO()
    result = run_rl(QuickstartSettings(out_dir=tmp_path / "qs"), RL, Console(file=out, width=200))
    text = out.getvalue()
    assert "training the SFT model first" not in text  # the saved SFT model is the starting point
    assert f"accuracy before RL: {100 * result.before.accuracy:.1f}%" in text
    assert f"accuracy after RL: {100 * result.after.accuracy:.1f}%" in text
    assert "GRPO: 12 steps" in text and "rollout reward" in text and "before RL" in text  # the table's header
    assert result.before.n == result.after.n == RL.eval_size
    assert result.after.accuracy >= result.before.accuracy + 0.15, text[-2000:]
    assert (result.model_dir / "config.json").is_file()
    rows = read_metrics(tmp_path / "qs" / "rl" / "train" / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, 13)) and all(0 <= r["reward"] <= 1 for r in rows)
