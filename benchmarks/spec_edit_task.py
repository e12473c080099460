"""Issue 43's edit workload: a small chat model trained to rename a variable in a code snippet, so its answer
mostly copies the prompt and speculative decoding's acceptance is real, not random-weight noise.

The task. A deterministic generator of short Python-like snippets (3-6 lines, 80-250 characters, built from a
small grammar of assignments, augmented assignments, appends, `for` and `if` blocks and a `return`, with
identifiers drawn from a word list: `acc`, `row_sum`, `val3`, ...) and the instruction
"Rename `OLD` to `NEW`:\\n<snippet>"; the answer is the snippet with every whole-word occurrence of OLD replaced
(`re.sub(r"\\bOLD\\b", ...)`: identifiers are word characters, so `acc_max`, `my_acc` and `acc2` keep their
names). OLD occurs at least twice (2.8 times on average); in about a fifth of the snippets a longer identifier
containing it (`acc_max`, `my_acc`, `accs`) is there too, so whole-word renaming is what the model has to learn,
not substring replacement; NEW occurs nowhere in the snippet. Problems come from `random.Random` seeded by strings, as
`astrai.quickstart.task` draws them: the held-out pool (`HELDOUT_POOL` problems of a seed) is drawn first and the
training problems from a second stream with every held-out question excluded, so nothing scored is ever trained on.

Every character is printable ASCII or a newline, so the quickstart's 100-token character vocabulary
(`astrai.quickstart.vocab.build_tokenizer`, ChatML template) covers the task unchanged: no tokenizer is built
here. Training goes through the quickstart's own functions (`_prepare_data`: SFT JSONL -> `astrai preprocess`
shards; `_train`: `astrai.train` with a `TrainConfig`, Muon + AdamW, cosine schedule) with a
`QuickstartSettings` carrying this task's sizes; scoring is `astrai.quickstart.evaluate.evaluate` (greedy
`astrai.generate`, exact match of the stripped completion), plus a per-character agreement (difflib's ratio).

The default run (`edit_model_config()`: chat_small's shape, 4 layers, hidden 128, 0.87M parameters, with a
576-token context; 1800 Muon steps of 4 packed rows x 576 tokens, lr 5e-3) took 536 s on the 2-core dev machine
(partly shared with other jobs) and scored 42% held-out exact match (84/200) with a mean character agreement of
0.949: the copy is right, the renames are where it errs (missed ones, a wrong word renamed, a longer identifier
containing OLD renamed). Batches of 4 beat 8 at the same tokens (41% vs 20%); lr 8e-3 and batches of 2 gave the
same ~40%.

Usage: python benchmarks/spec_edit_task.py [--steps N] [--retrain] [--out runs/spec_edit] [--eval-size N]
Prints the training progress, the held-out accuracy and sample pairs; the last stdout line is the JSON report.
"""

from __future__ import annotations

import argparse
import difflib
import json
import random
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from astrai.io.model import load
from astrai.models.config import ModelConfig
from astrai.quickstart.evaluate import EvalResult, evaluate, render_prompt
from astrai.quickstart.run import QuickstartSettings, _prepare_data, _train
from astrai.quickstart.task import Problem
from astrai.quickstart.vocab import VOCAB_SIZE, build_tokenizer

KIND = "rename"
SEQ_LEN = 576  # the longest chat is 526 tokens (~25 instruction + 2 x 250 snippet characters + template)
MIN_CHARS, MAX_CHARS = 80, 250
MIN_LINES, MAX_LINES = 3, 6
HELDOUT_POOL = 1000  # held-out problems per seed, all excluded from training; `edit_prompts` serves n <= this
N_TRAIN = 30_000  # training problems (more than the default run consumes: no chat is seen twice)
STEPS = 1800
BATCH_SIZE = 4
TARGET_SHARE = 0.2  # chance that an identifier slot takes the name to rename (it must still occur twice)
DISTRACTOR_SHARE = 0.2  # snippets given a longer identifier containing that name

# Identifier words: none is a Python keyword or one of the builtins the grammar calls.
WORDS = (
    "acc", "total", "count", "idx", "items", "vals", "buf", "res", "tmp", "key", "row", "col", "node", "data",
    "out", "name", "size", "step", "lo", "hi", "mid", "left", "right", "cur", "prev", "best", "score", "seen",
    "stack", "queue", "word", "line", "text", "parts", "num", "val", "item", "x", "y", "z", "i", "j", "k", "n",
    "m", "w", "h", "dx", "dy", "pos", "rate", "cost", "delta", "limit", "span", "chunk", "head", "tail",
    "grid", "cell", "path", "edge", "depth", "width", "level", "index", "value", "scale", "base", "offset",
)  # fmt: skip
_CALLS = ("len", "abs", "sum", "min", "max", "int", "str", "sorted")
_FUNC_WORDS = ("f", "g", "run", "solve", "update", "merge", "scan", "walk", "fold", "mix", "pack", "build")


def rename(code: str, old: str, new: str) -> str:
    """`code` with every whole-word occurrence of identifier `old` replaced by `new` (`acc_max` keeps `acc`)."""
    return re.sub(rf"\b{re.escape(old)}\b", new, code)


def occurrences(code: str, name: str) -> int:
    """Whole-word occurrences of `name` in `code`."""
    return len(re.findall(rf"\b{re.escape(name)}\b", code))


def _identifier(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.55:
        return rng.choice(WORDS)
    if r < 0.9:
        return f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"
    return f"{rng.choice(WORDS)}{rng.randint(0, 9)}"


def _distractor(rng: random.Random, old: str) -> str:
    """A longer identifier that contains `old` but is another name (its whole-word form must survive)."""
    return rng.choice(
        (f"{old}_{rng.choice(WORDS)}", f"{rng.choice(WORDS)}_{old}", f"{old}s", f"{old}{rng.randint(0, 9)}")
    )


class _Snippet:
    """Builds one snippet line by line; `pick` favours the target name so it recurs."""

    def __init__(self, rng: random.Random, old: str, names: list[str]) -> None:
        self.rng, self.old, self.names = rng, old, names
        self.lines: list[str] = []

    def pick(self) -> str:
        return self.old if self.rng.random() < TARGET_SHARE else self.rng.choice(self.names)

    def atom(self) -> str:
        r = self.rng.random()
        if r < 0.55:
            return self.pick()
        if r < 0.8:
            return str(self.rng.randint(0, 99))
        if r < 0.9:
            return f"{self.pick()}[{self.rng.randint(0, 9)}]"
        return f"{self.rng.choice(_CALLS)}({self.pick()})"

    def expr(self) -> str:
        r = self.rng.random()
        if r < 0.4:
            return self.atom()
        if r < 0.85:
            return f"{self.atom()} {self.rng.choice('+-*')} {self.atom()}"
        return f"{self.rng.choice(('min', 'max'))}({self.pick()}, {self.atom()})"

    def simple(self) -> str:
        r = self.rng.random()
        if r < 0.45:
            return f"{self.pick()} = {self.expr()}"
        if r < 0.75:
            return f"{self.pick()} {self.rng.choice('+-*')}= {self.expr()}"
        if r < 0.9:
            return f"{self.pick()}.append({self.expr()})"
        return f"print({self.pick()})"

    def block(self) -> list[str]:
        if self.rng.random() < 0.5:
            source = self.pick() if self.rng.random() < 0.6 else f"range({self.atom()})"
            head = f"for {self.pick()} in {source}:"
        else:
            head = f"if {self.pick()} {self.rng.choice(('>', '<', '==', '!='))} {self.atom()}:"
        return [head, "    " + self.simple()]


def _snippet(rng: random.Random, old: str, names: list[str]) -> str:
    s = _Snippet(rng, old, names)
    n_lines = rng.randint(MIN_LINES, MAX_LINES)
    header = rng.random() < 0.6
    indent = ""
    body: list[str] = []
    if header:
        params = ", ".join(dict.fromkeys(s.pick() for _ in range(rng.randint(1, 3))))
        body.append(f"def {rng.choice(_FUNC_WORDS)}({params}):")
        indent = "    "
    while len(body) < n_lines - header:  # the return (with a header) is the last line
        room = n_lines - header - len(body)
        chunk = s.block() if room >= 2 and rng.random() < 0.35 else [s.simple()]
        body += [indent + line for line in chunk]
    if header:
        body.append(f"{indent}return {s.expr()}")
    return "\n".join(body)


def _sample(rng: random.Random) -> Problem | None:
    """One problem, or None when the draw misses the constraints (the caller draws again)."""
    old = _identifier(rng)
    names = [n for n in dict.fromkeys(_identifier(rng) for _ in range(rng.randint(2, 4))) if n != old]
    if rng.random() < DISTRACTOR_SHARE:
        names.append(_distractor(rng, old))
    code = _snippet(rng, old, names or [_identifier(rng)])
    new = _identifier(rng)
    lines = code.count("\n") + 1
    if not (MIN_CHARS <= len(code) <= MAX_CHARS and MIN_LINES <= lines <= MAX_LINES):
        return None
    if occurrences(code, old) < 2 or new == old or new in code:
        return None
    return Problem(KIND, f"Rename `{old}` to `{new}`:\n{code}", rename(code, old, new))


def make_edit_problems(n: int, *, stream: str, exclude: Iterable[str] = frozenset()) -> list[Problem]:
    """`n` distinct problems from the named random stream, skipping questions in `exclude`; deterministic."""
    rng = random.Random(f"astrai.spec_edit:{stream}")
    out, seen = [], set(exclude)
    while len(out) < n:
        problem = _sample(rng)
        if problem is not None and problem.question not in seen:
            seen.add(problem.question)
            out.append(problem)
    return out


def heldout_problems(n: int = HELDOUT_POOL, seed: int = 0) -> list[Problem]:
    """The first `n` of seed `seed`'s held-out pool (never in that seed's training set)."""
    if not 0 < n <= HELDOUT_POOL:
        raise ValueError(f"n must be in 1..{HELDOUT_POOL} (the held-out pool), got {n}")
    return make_edit_problems(HELDOUT_POOL, stream=f"heldout:{seed}")[:n]


def split_edit_problems(n_train: int = N_TRAIN, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """(training problems, the held-out pool): disjoint by question, the held-out pool drawn first."""
    test = heldout_problems(HELDOUT_POOL, seed)
    train = make_edit_problems(n_train, stream=f"train:{seed}", exclude={p.question for p in test})
    return train, test


def edit_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` held-out questions rendered with the chat template (user turn + assistant header), ready for
    `Tokenizer.encode_prompt` / `astrai.generate`; the answers are `heldout_problems(n, seed)[i].answer`."""
    tokenizer = build_tokenizer()
    return [render_prompt(tokenizer, p) for p in heldout_problems(n, seed)]


def edit_model_config(*, hidden: int = 128, layers: int = 4, seq_len: int = SEQ_LEN) -> ModelConfig:
    """A chat_small-shaped llama (head_dim 32, MLP 3x, tied embeddings) with the context this task needs."""
    return ModelConfig(
        model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32, head_dim=32,
        max_position_embeddings=seq_len, tie_word_embeddings=True,
    )  # fmt: skip


def build_edit_model(
    out_dir: Path = Path("runs/spec_edit"),
    *,
    steps: int = STEPS,
    retrain: bool = False,
    console: Console | None = None,
    model_cfg: ModelConfig | None = None,
    n_train: int = N_TRAIN,
    batch_size: int = BATCH_SIZE,
    lr: float = 5e-3,
    compile: bool = True,
    seed: int = 0,
) -> Path:
    """Train the edit model (unless out_dir/model exists and `retrain` is off) and return its HF folder.

    Files as the quickstart's: out_dir/data (tokenizer, train.jsonl, shards), out_dir/train (the run),
    out_dir/model (the final folder, tokenizer included) and out_dir/build.json (settings, and train_s: the
    seconds of data preparation + training).
    """
    console = console or Console()
    out_dir = Path(out_dir)
    model_dir = out_dir / "model"
    if (model_dir / "config.json").is_file() and not retrain:
        console.print(f"reusing the trained model in {model_dir} (pass --retrain to train again)")
        return model_dir
    model_cfg = model_cfg or edit_model_config()
    seq_len = model_cfg.max_position_embeddings
    settings = QuickstartSettings(
        out_dir=out_dir, retrain=True, model="spec-edit", steps=steps, batch_size=batch_size, seq_len=seq_len,
        lr=lr, compile=compile, seed=seed,
    )  # fmt: skip
    train_problems, test_problems = split_edit_problems(n_train, seed)
    console.print(f"spec edit task: rename a variable ({len(train_problems):,} training snippets, "
                  f"{len(test_problems):,} held out) for {steps} steps of {batch_size} x {seq_len} tokens")  # fmt: skip
    start = time.perf_counter()
    tokenizer_dir, shards = _prepare_data(settings, train_problems, console)
    trained = _train(settings, model_cfg, tokenizer_dir, shards)
    seconds = time.perf_counter() - start
    if model_dir.exists():
        shutil.rmtree(model_dir)
    shutil.copytree(trained, model_dir)
    info = {"steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "n_train": n_train, "seed": seed,
            "hidden_size": model_cfg.hidden_size, "layers": model_cfg.num_hidden_layers,
            "train_s": round(seconds, 1)}  # fmt: skip
    (out_dir / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    console.print(f"trained in {seconds:.0f} s; model saved in {model_dir}")
    return model_dir


def char_agreement(prediction: str, answer: str) -> float:
    """difflib's similarity of the two strings: 2 x matching characters / total characters (1.0: identical)."""
    return difflib.SequenceMatcher(None, prediction, answer, autojunk=False).ratio()


def evaluate_edits(model_dir: Path, n: int = 200, seed: int = 0) -> EvalResult:
    """Greedy (`astrai.generate`, temperature 0) exact match on the first `n` held-out problems of `seed`."""
    model = load(model_dir)
    problems = heldout_problems(n, seed)
    longest_prompt = max(len(model.tokenizer.encode_prompt(render_prompt(model.tokenizer, p))) for p in problems)
    room = model.config.max_position_embeddings - longest_prompt
    max_tokens = min(max(len(p.answer) for p in problems) + 8, room)
    return evaluate(model, problems, max_tokens=max_tokens, batch_size=64)


def edit_accuracy(model_dir: Path, n: int = 200, seed: int = 0) -> tuple[float, float]:
    """(exact-match rate, mean character agreement) of greedy answers on `n` held-out problems."""
    result = evaluate_edits(model_dir, n, seed)
    return result.accuracy, _mean_agreement(result)


def _mean_agreement(result: EvalResult) -> float:
    return sum(char_agreement(s.prediction, s.problem.answer) for s in result.samples) / result.n


def _params(model_dir: Path) -> int:
    model = load(model_dir)
    return sum(t.numel() for t in torch.utils._pytree.tree_leaves(model.params))


def _samples_table(result: EvalResult, n: int) -> Table:
    table = Table(title="held-out samples", show_lines=True)
    for column in ("prompt", "model", ""):
        table.add_column(column)
    for s in result.samples[:n]:
        table.add_row(s.problem.question, s.prediction, "[green]✓[/]" if s.correct else "[red]✗[/]")
    return table


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("runs/spec_edit"))
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    model_dir = build_edit_model(args.out, steps=args.steps, retrain=args.retrain, console=console)
    build = args.out / "build.json"
    info = json.loads(build.read_text()) if build.is_file() else {}
    start = time.perf_counter()
    result = evaluate_edits(model_dir, args.eval_size)
    eval_s = time.perf_counter() - start
    agreement = _mean_agreement(result)
    console.print(_samples_table(result, args.samples))
    console.print(f"held-out exact match: {result.summary}; mean char agreement {agreement:.3f}")
    report = {
        "benchmark": "spec_edit_task", "accuracy": result.accuracy, "char_agreement": round(agreement, 4),
        "n": result.n, "train_s": info.get("train_s"), "eval_s": round(eval_s, 1), "params": _params(model_dir),
        "steps": info.get("steps"), "model_dir": str(model_dir),
    }  # fmt: skip
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
