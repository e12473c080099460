"""GRPO rollouts through the *compiled* engine across optimizer steps (`astrai.train.rollout`).

The rollout engine serves the trainer's own tensors, and its compiled decode step and sampler do not guard on the
parameters (`astrai.inference.step.without_param_guards`): an optimizer step changes those tensors in place and
`Rollouts.after_step` (`Engine.update_params()`) must then refresh whatever the engine derived from them (the CPU
weight packs) and drop the prefix cache. These tests run real rollouts, real AdamW steps (`GRPOStep`, eager) and
`after_step`, for the full model and for LoRA (the served tree is built once by `apply_lora` over the live adapters),
and check:
- no compile or recompile after the first rollout: Dynamo's frame counters and the compiled decode step's cache
  entries stay where the first rollout left them;
- each rollout's log-probs equal an independent eager teacher-forced forward of the *current* weights
  (`token_logprobs_of`, full forward, no cache, no packs); the same prompts come back every step, so a prefix
  cached with the old weights, a stale weight pack or a stale adapter would show as a mismatch;
- negative control: the same comparison against the weights of the step before fails (the steps change the
  weights enough for the check to see it).
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from astrai.configs.models import tiny
from astrai.io.tokenizer import Tokenizer
from astrai.models.decoder import init_params
from astrai.nn.lora import LoRAConfig, apply_lora, init_lora
from astrai.quickstart.task import make_problems
from astrai.quickstart.vocab import save_tokenizer
from astrai.train.config import GRPOConfig
from astrai.train.data import PromptBatch
from astrai.train.grpo import GRPOStep
from astrai.train.optim import AdamWConfig
from astrai.train.preference import token_logprobs_of
from astrai.train.rollout import Rollouts, make_rollouts
from astrai.train.step import StepOptions, full_params, init_train_state
from astrai.tree import tree_map

STEPS = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple:
    """(tokenizer, model config, two prompt batches of two items each: addition questions, one over a page)."""
    tok = Tokenizer.from_dir(save_tokenizer(tmp_path_factory.mktemp("rollout_tok") / "tokenizer"))
    cfg = attrs.evolve(
        tiny(), vocab_size=len(tok), eos_token_id=tok.eos_token_ids, bos_token_id=None, num_hidden_layers=1
    )  # one block: the compiles take seconds
    problems = make_problems("add2", 4, seed=5)
    items = [{"prompt": torch.tensor(tok.encode_prompt(p.question + " Please answer with the sum only.")),
              "answer": p.answer} for p in problems]  # fmt: skip
    assert all(len(it["prompt"]) > 16 for it in items)  # a full page: the prefix cache would hold it
    batches = [PromptBatch(items=items[:2], indices=[0, 1]), PromptBatch(items=items[2:], indices=[2, 3])]
    return tok, cfg, batches


def _frames() -> int:
    """Graphs Dynamo has captured, plus its recompiles (a compile that hits inductor's cache still counts)."""
    return counters["stats"]["unique_graphs"] + sum(counters["recompiles"].values())


def _decode_cache_entries(rollouts) -> int:
    step = rollouts.engine.runner.compiled_decode
    step = getattr(step, "compiled", step)  # a CPU step sits in `thread_count.AnyThreadCount`
    return len(_debug_get_cache_entry_list(step._torchdynamo_orig_callable.__code__))


def _check_logprobs(batches, out, policy_params, cfg, *, atol=2e-4) -> float:
    """Largest |engine log-prob - fresh eager forward of `policy_params`| over the packed completions."""
    worst = 0.0
    for mb in out:
        with torch.no_grad():
            want = token_logprobs_of(policy_params, cfg, mb.tokens) * mb.mask
        worst = max(worst, (mb.old_logps - want).abs().max().item())
    return worst


@pytest.mark.parametrize("lora", [pytest.param(False, marks=pytest.mark.slow), True], ids=["full", "lora"])  # full 40 s
def test_compiled_rollouts_survive_optimizer_steps_without_recompiling(setup, lora):
    tok, cfg, batches = setup
    base = init_params(cfg, seed=0)
    if lora:
        trainable = init_lora(base, LoRAConfig(r=4), seed=0)
        trainable = tree_map(lambda t: t + 0.02 * torch.randn_like(t), trainable)  # B non-zero: adapters count
        frozen, to_params = base, apply_lora
    else:
        frozen, to_params = None, full_params
    optim = AdamWConfig(lr=3e-2, weight_decay=0.0)
    state = init_train_state(trainable if lora else base, optim)
    grpo = GRPOConfig(num_generations=4, max_completion_tokens=6, rewards=(r"regex:(?s).*\d.*",), beta=0.0,
                      num_iterations=2)  # logprobs packed from the engine (temperature 1, fp32)  # fmt: skip
    policy = to_params(frozen, state.trainable)  # built once, as `_Run.prepare_reference` does
    rollouts = make_rollouts(
        grpo, start=base, shared=lora, model_cfg=cfg, policy=policy, tokenizer=tok, eos=tok.eos_token_ids,
        opts=StepOptions(compile=True), seq_len=64, prompts_per_step=4, seed=0, device=torch.device("cpu"),
    )  # fmt: skip
    assert rollouts.engine.runner.compiled_decode is not None  # the run compiles: so do its rollouts
    step = GRPOStep(cfg, StepOptions(compile=False), optim, grpo, trainable=state.trainable, to_params=to_params)

    start = _frames()
    out = rollouts.rollout(batches, 0)  # the first rollout compiles decode and the sampler
    frames, entries = _frames(), _decode_cache_entries(rollouts)
    assert frames > start and entries >= 1  # the counters do see a compile
    assert _check_logprobs(batches, out, to_params(frozen, state.trainable), cfg) < 2e-4
    for k in range(1, STEPS + 1):
        before = tree_map(lambda t: t.detach().clone(), state.trainable)
        step(state, out, 1.0, frozen)  # AdamW, in place on the served tensors
        rollouts.after_step()
        out = rollouts.rollout(batches, k)
        assert rollouts.engine.stats().kv_pages_cached > 0  # the prompts were cached (and dropped next step)
        now = _check_logprobs(batches, out, to_params(frozen, state.trainable), cfg)
        stale = _check_logprobs(batches, out, to_params(frozen, before), cfg)
        assert now < 2e-4, f"step {k}: the rollout did not use the updated weights (max |diff| {now:.2e})"
        assert stale > 1e-2, f"step {k}: the step hardly changed the weights: the check could not see staleness"
        assert _frames() == frames, f"step {k}: Dynamo compiled again ({dict(counters['recompiles'])})"
        assert _decode_cache_entries(rollouts) == entries


def test_grpo_rollouts_compile_with_the_run(setup):
    """The rollout engine compiles exactly when the run does (`TrainConfig.compile`; recipes compile, the RL
    quickstart does not): a short eager run pays no compile, a compiled one gets compiled rollouts."""
    tok, cfg, _ = setup
    for compile in (False, True):
        r = Rollouts(GRPOConfig(num_generations=2, max_completion_tokens=2), model_cfg=cfg,
                     policy=init_params(cfg, seed=0), tokenizer=tok, eos=tok.eos_token_ids, reference=None,
                     opts=StepOptions(compile=compile), seq_len=32, prompts_per_step=1, seed=0,
                     device=torch.device("cpu"))  # fmt: skip
        assert (r.engine.runner.compiled_decode is not None) == compile
