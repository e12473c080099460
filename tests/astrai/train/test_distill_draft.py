"""A distilled draft serves speculative decoding (issue 43): a student distilled from a teacher folder with
`astrai train`'s distill objective has its guesses accepted by the teacher, through the engine, far more often
than an untrained draft of the same shape (the negative control), and the output stays the teacher's own.

The teacher is a random 2-layer `tiny` model with a sharpened head (a peaked, deterministic greedy policy). A
draft must predict the teacher where it runs, on the teacher's own output, so the distillation data is the
teacher's sampled answers to the quickstart's addition questions (sequence-level data, as docs/training.md
advises: a random teacher's output looks nothing like the chats it was asked); the test prompts are questions the
distillation never saw.
"""

from __future__ import annotations

import json

import attrs
import pytest

from astrai.configs.models import tiny
from astrai.data.config import config_from_dict
from astrai.data.preprocess import preprocess
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.io.model import Model, load, save
from astrai.io.tokenizer import Tokenizer
from astrai.models.decoder import init_params
from astrai.quickstart.task import make_problems
from astrai.train import loop
from astrai.train.config import TrainConfig
from astrai.train.distill import DistillConfig
from astrai.train.metrics import read_metrics
from astrai.train.optim import AdamWConfig
from astrai.train.schedule import ScheduleConfig


def _student(vocab: int):
    return attrs.evolve(tiny(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=1, head_dim=16)


def _prompts(tokenizer, n: int, seed: int) -> tuple[list[str], list[str]]:
    questions = [p.question for p in make_problems("add2", n, seed=seed)]
    return questions, [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                       for q in questions]  # fmt: skip


@pytest.fixture(scope="module")
def pair(sft_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_draft")
    tokenizer = Tokenizer.from_dir(sft_data[0])
    cfg = attrs.evolve(tiny(len(tokenizer)), num_hidden_layers=2, eos_token_id=tokenizer.eos_token_ids)
    params = init_params(cfg, seed=7)
    params.lm_head.weight.mul_(8.0)
    teacher = Model(config=cfg, params=params, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids)
    teacher_dir = save(teacher, root / "teacher")
    questions, prompts = _prompts(tokenizer, 160, seed=0)
    with Engine(teacher, EngineConfig(compile=False, kv_budget_tokens=16384)) as engine:
        answers = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.8, seed=1, ignore_eos=True))
    with open(root / "teacher.jsonl", "w") as f:
        for question, answer in zip(questions, answers, strict=True):
            chat = [{"role": "user", "content": question}, {"role": "assistant", "content": answer.outputs[0].text}]
            f.write(json.dumps({"messages": chat}) + "\n")
    preprocess(config_from_dict({
        "kind": "sft", "inputs": [str(root / "teacher.jsonl")], "tokenizer": str(sft_data[0]),
        "output": str(root / "shards"), "sections": [{"field": "messages", "action": "$role", "template": True}],
        "preprocessing": {"max_seq_len": 96, "max_packed_len": 96},
    }))  # fmt: skip
    run = TrainConfig(data=root / "shards", out_dir=root / "run", model="small", seq_len=96, batch_size=8, steps=80,
                      optim=AdamWConfig(lr=3e-3, weight_decay=0.0), schedule=ScheduleConfig(kind="constant"),
                      compile=False, distill=DistillConfig(teacher=teacher_dir))  # fmt: skip
    result = loop.train(run, _student(len(tokenizer)))
    untrained_cfg = load(result.model_dir).config
    untrained = save(Model(config=untrained_cfg, params=init_params(untrained_cfg, seed=3), tokenizer=tokenizer,
                           eos_token_ids=tokenizer.eos_token_ids), root / "untrained")  # fmt: skip
    kl = [row["kl"] for row in read_metrics(root / "run" / "metrics.jsonl", kind="train")]
    return teacher, result.model_dir, untrained, kl


def _serve(teacher, draft_dir):
    _, prompts = _prompts(teacher.tokenizer, 12, seed=99)
    spec = {"model": str(draft_dir), "num_speculative_tokens": 4} if draft_dir else None
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    with Engine(teacher, EngineConfig(compile=False, kv_budget_tokens=4096, speculative=spec)) as engine:
        outs = engine.generate(prompts, params)
        stats = engine.stats()
    return [o.outputs[0].token_ids for o in outs], stats.spec_accepted_tokens / max(1, stats.spec_draft_tokens)


def test_a_distilled_draft_is_accepted_far_more_than_an_untrained_one(pair):
    teacher, distilled, untrained, kl = pair
    assert sum(kl[-5:]) / 5 < 0.5 * kl[0], kl  # the distillation loss fell
    plain, _ = _serve(teacher, None)
    with_distilled, rate = _serve(teacher, distilled)
    with_untrained, control = _serve(teacher, untrained)
    assert with_distilled == plain == with_untrained  # lossless either way
    assert rate > 0.4 and rate > control + 0.3, (rate, control)  # measured 0.59 and 0.0
