"""`astrai quickstart --rl`: online GRPO on the quickstart's SFT model, with an exact-match reward, in minutes on CPU.

The task: the SFT model (`run.py`) only ever saw one phrasing, "What is 47 + 85?". Asked the same sums in other
words (``PARAPHRASES``, e.g. "What's 47 + 85?"), it answers only some of them exactly, which is the regime where
GRPO learns: among the G sampled answers to a prompt some are right and some are wrong, so the group advantages
are informative. How well a model answers each phrasing varies from one SFT model to the next (six 800-step
models answered "What's a + b?" 6.5% to 84% of the time), so the stage first probes the candidates on 100 RL
prompts each and asks in the one nearest 40% within 20-70% (`choose_paraphrase`; `--grpo.paraphrase` fixes
one). Other arithmetic (a 1-digit operand, 3-digit operands, three addends, subtraction) scored 0-8%, too far
off for rewards to appear in G samples. The reward is verifiable (`exact_match:text`: the completion,
stripped, equals the sum) and RL never sees a reference answer text as a training target, only the 0/1 reward
of its own samples.

Splits: the RL prompts use the operand pairs of the SFT training set, the held-out RL problems the SFT held-out
pairs (`split_problems("add2")`), so every scored question is new to both SFT and RL. Accuracy before and after
is greedy exact match on the same held-out problems (`evaluate.py`, as the SFT quickstart reports it).

Notable choices: the GRPO trainer is `astrai.train.loop.train` with a `GRPOConfig` (rollouts on astrai's engine
serving the trainer's own weights), so this is also a CPU smoke test of that path; AdamW at a constant small LR,
no KL reference (beta 0), DAPO token normalisation, completions capped at 6 tokens (a sum has at most 3 digits
plus the end-of-turn token). Files land in `out_dir/rl/`: `prompts.jsonl`, `train/` (the GRPO run) and `model/`.

Not here: the SFT stage itself (`run.py`, reused or trained first), other reward shapes (partial credit per
digit), a KL-regularised or LoRA variant (the trainer supports both: `GRPOConfig.beta`, `TrainConfig.lora`).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import attrs
from rich.console import Console
from rich.table import Table

from astrai.io.model import Model, load
from astrai.models.config import ModelConfig
from astrai.quickstart.evaluate import EvalResult, EvalSample, evaluate
from astrai.quickstart.run import QuickstartSettings, run_quickstart
from astrai.quickstart.task import Problem, split_problems
from astrai.train.config import GRPOConfig, TrainConfig
from astrai.train.loop import train
from astrai.train.metrics import read_metrics
from astrai.train.optim import OptimConfig
from astrai.train.schedule import ScheduleConfig

PARAPHRASES = ("What's {a} + {b}?", "Compute {a} + {b}.", "What is {a} plus {b}?", "what is {a} + {b}?",
               "How much is {a} + {b}?", "what's {a} + {b}?", "What's {a}+{b}?")  # fmt: skip
"""Candidate question templates of the RL task; the SFT model saw only "What is {a} + {b}?". How well a given SFT
model answers each varies a lot from model to model (the 800-step models here: 6.5-84% on the first), so the RL
stage probes them and asks in the one that starts nearest `TARGET` (`choose_paraphrase`)."""
KIND = "add2-paraphrased"
TARGET, IN_RANGE = 0.4, (0.2, 0.7)  # the start GRPO learns best from: some right and some wrong samples per group


@attrs.frozen(kw_only=True)
class RLSettings:
    """The GRPO stage of `astrai quickstart --rl` (the CLI exposes every field under `--grpo.`)."""

    steps: int = 80
    """GRPO optimizer steps (one rollout of `batch_size` prompts x `num_generations` samples each). 80 gained at
    least as much as 40 from each of six SFT models, 12.5 points more on average (docs/training.md)."""
    batch_size: int = 16
    """Prompts per step."""
    num_generations: int = 8
    """G: sampled answers per prompt."""
    lr: float = 3e-5
    """AdamW learning rate (constant). 1e-4 also works from the 800-step SFT model but made a less trained one
    worse, and 3e-4 collapses the rewards to 0 within 5 steps."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    max_completion_tokens: int = 6
    """Tokens per sampled answer at most."""
    eval_size: int | None = None
    """Held-out problems scored before and after (default: all 810)."""
    samples: int = 8
    """Rows of the before/after sample table."""
    compile: bool = False
    """torch.compile the GRPO step (off: compile time would dominate a run this short)."""
    paraphrase: str | None = None
    """The question template ("{a}", "{b}" placeholders); None: probe `PARAPHRASES` and take the one whose
    accuracy is nearest 40% within 20-70% (or nearest 40% when none is in that range)."""
    probe_size: int = 100
    """RL training prompts per candidate template when probing."""


@attrs.frozen
class RLResult:
    """Greedy exact-match accuracy on the same held-out problems before and after GRPO, and the run's files."""

    before: EvalResult
    after: EvalResult
    model_dir: Path
    train_seconds: float


def rl_problems(seed: int = 0, template: str = PARAPHRASES[0]) -> tuple[list[Problem], list[Problem]]:
    """(RL training prompts, held-out problems): the SFT split's pairs, asked with `template`."""
    sft_train, sft_test = split_problems("add2", seed=seed)

    def rephrase(problems: list[Problem]) -> list[Problem]:
        out = []
        for p in problems:
            a, b = (int(x) for x in p.question.removeprefix("What is ").removesuffix("?").split(" + "))
            out.append(Problem(KIND, template.format(a=a, b=b), p.answer))
        return out

    return rephrase(sft_train), rephrase(sft_test)


def pick_paraphrase(accuracies: dict[str, float]) -> str:
    """The template whose accuracy is nearest `TARGET` among those within `IN_RANGE`, else the one nearest
    `TARGET` overall (ties: the first). Out of range, a low start is as good as a high one: GRPO lifted models
    from 6.5% and 19% by 46-71 points, while a start at 74% leaves only 26 to gain."""
    low, high = IN_RANGE
    inside = {t: a for t, a in accuracies.items() if low <= a <= high} or accuracies
    return min(inside, key=lambda t: abs(inside[t] - TARGET))


def choose_paraphrase(model: Model, seed: int, size: int, console: Console) -> str:
    """Probe every `PARAPHRASES` template on `size` RL training prompts (greedy exact match) and pick one
    (`pick_paraphrase`); prints the probe's table."""
    accuracies = {}
    for template in PARAPHRASES:
        accuracies[template] = evaluate(model, rl_problems(seed, template)[0][:size]).accuracy
    chosen = pick_paraphrase(accuracies)
    table = Table(title=f"probe: the SFT model on {size} RL prompts per phrasing")
    for column in ("question template", "accuracy", ""):
        table.add_column(column)
    for template, accuracy in accuracies.items():
        table.add_row(template, f"{100 * accuracy:.1f}%", "chosen" if template == chosen else "")
    console.print(table)
    return chosen


def _write_prompts(problems: list[Problem], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.question, "answer": p.answer}) + "\n")
    return path


def _marked(sample: EvalSample) -> str:
    return f"{sample.prediction} {'[green]✓[/]' if sample.correct else '[red]✗[/]'}"


def _comparison_table(before: EvalResult, after: EvalResult, n: int) -> Table:
    """Held-out questions, the answers before and after RL, the expected answer; changed rows first."""
    table = Table(title="held-out problems, before and after RL")
    for column in ("user", "before RL", "after RL", "expected"):
        table.add_column(column)
    pairs = list(zip(before.samples, after.samples, strict=True))
    pairs.sort(key=lambda pair: pair[0].correct == pair[1].correct)  # stable: changed answers first
    for b, a in pairs[:n]:
        table.add_row(b.problem.question, _marked(b), _marked(a), b.problem.answer)
    return table


def _reward_trend(run_dir: Path) -> str:
    """The mean rollout reward over the first and the last quarter of the run's steps."""
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    rewards = [r["reward"] for r in rows if "reward" in r]
    if not rewards:
        return "no rewards logged"
    k = max(1, len(rewards) // 4)
    return f"rollout reward {sum(rewards[:k]) / k:.2f} (first {k} steps) -> {sum(rewards[-k:]) / k:.2f} (last {k})"


def run_rl(
    sft: QuickstartSettings,
    s: RLSettings = RLSettings(),
    console: Console | None = None,
    *,
    model_cfg: ModelConfig | None = None,
) -> RLResult:
    """GRPO the quickstart's SFT model on paraphrased additions; report accuracy before and after.

    Args:
        sft: the SFT quickstart's settings: its `out_dir/model` is the starting point, trained first (with
            these settings) when missing; RL files go to `out_dir/rl`.
        s: the GRPO stage's settings.
        console: where to report (default: a new rich console).
        model_cfg: the SFT model's shape, used only when the SFT model has to be trained (see `run_quickstart`).
    """
    console = console or Console()
    sft_dir = sft.out_dir / "model"
    if not (sft_dir / "config.json").is_file() or sft.retrain:
        console.print("[bold]RL quickstart: training the SFT model first[/]")
        run_quickstart(sft, console, model_cfg=model_cfg)
    sft_model = load(sft_dir)
    template = s.paraphrase or choose_paraphrase(sft_model, sft.seed, s.probe_size, console)
    train_problems, test_problems = rl_problems(sft.seed, template)
    if s.eval_size is not None:
        test_problems = test_problems[: s.eval_size]
    rl_dir = sft.out_dir / "rl"
    console.print(
        f"RL quickstart: GRPO on {sft_dir} with questions phrased as {template!r} "
        f"({len(train_problems):,} training prompts, {len(test_problems):,} held out), {s.steps} steps of "
        f"{s.batch_size} prompts x {s.num_generations} samples, reward exact_match:text"
    )
    before = evaluate(sft_model, test_problems)
    console.print(f"accuracy before RL: {100 * before.accuracy:.1f}% ({before.correct}/{before.n} held-out problems)")

    shutil.rmtree(rl_dir / "train", ignore_errors=True)  # an RL rerun starts over from the SFT model
    cfg = TrainConfig(
        data=_write_prompts(train_problems, rl_dir / "prompts.jsonl"), out_dir=rl_dir / "train", model=str(sft_dir),
        seq_len=96, batch_size=s.batch_size, steps=s.steps, optim=OptimConfig(name="adamw", lr=s.lr, weight_decay=0.0),
        schedule=ScheduleConfig(kind="constant"), max_grad_norm=1.0, compile=s.compile, seed=sft.seed, save_every=0,
        keep_last=1,
        grpo=GRPOConfig(num_generations=s.num_generations, max_completion_tokens=s.max_completion_tokens,
                        temperature=s.temperature, rewards=("exact_match:text",)),
    )  # fmt: skip
    start = time.perf_counter()
    result = train(cfg)
    seconds = time.perf_counter() - start
    if result.model_dir is None:
        raise RuntimeError(f"GRPO stopped at step {result.steps}; rerun `astrai quickstart --rl`")
    model_dir = rl_dir / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    shutil.copytree(result.model_dir, model_dir)
    console.print(f"GRPO: {s.steps} steps in {seconds:.0f}s; {_reward_trend(result.run_dir)}")

    after = evaluate(load(model_dir), test_problems)
    console.print(_comparison_table(before, after, s.samples))
    console.print(f"accuracy before RL: {100 * before.accuracy:.1f}% ({before.correct}/{before.n} held-out problems)")
    console.print(f"accuracy after RL: {100 * after.accuracy:.1f}% ({after.correct}/{after.n} held-out problems)")
    console.print(f"model saved in {model_dir}\nchat with it: astrai chat {model_dir}")
    return RLResult(before=before, after=after, model_dir=model_dir, train_seconds=seconds)
