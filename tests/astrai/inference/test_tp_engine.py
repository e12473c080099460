"""Tensor-parallel inference (`EngineConfig.tensor_parallel_size`, `astrai serve --tensor-parallel-size`) on CPU.

Two ranks (rank 0 in this process, rank 1 spawned) against one process: greedy outputs are equal under staggered
arrivals (requests joining while others decode, prefix-cache hits, chunked prefill) for a GQA model and for
DeepSeek's MLA + MoE (replicated latent cache, expert parallel), both with random non-zero biases on every
projection that can carry one (row-parallel ones are added on rank 0 only). Failure: killing rank 1 fails the in-flight
request with a message naming the rank, and a server whose rank dies exits with that message in bounded time.
"""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from astrai.configs.models import tiny
from astrai.inference.engine import Engine, EngineConfig, EngineDeadError
from astrai.inference.params import SamplingParams
from astrai.inference.tp import TPRunner
from astrai.io.model import Model
from astrai.models.decoder import init_params
from helpers import random_biases, tiny_model_dir

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 30, 31], [40] * 20]


def _staggered(model: Model, tp: int) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """Greedy outputs of PROMPTS, one request joining every 3 steps (small step budget: chunked prefill), and the
    chosen tokens' logprobs [4, 10] (a wrong logit shows there before it flips a greedy token)."""
    cfg = EngineConfig(compile=False, tensor_parallel_size=tp, kv_budget_tokens=256, page_size=4,
                       max_step_tokens=8, max_running=4, background=False, seed=0)  # fmt: skip
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True)
    with Engine(model, cfg) as engine:
        handles, pending, steps = [], list(PROMPTS), 0
        while pending or engine.step():
            if pending and steps % 3 == 0:
                handles.append(engine.submit(pending.pop(0), params))
            steps += 1
        outs = [h.result().outputs[0] for h in handles]
        return [o.token_ids for o in outs], torch.tensor([o.logprobs for o in outs])


def _tp_worker():
    """The tensor-parallel model checks' worker module (tests/astrai/models/tp_worker.py): its tiny configs."""
    path = Path(__file__).parents[1] / "models" / "tp_worker.py"
    spec = importlib.util.spec_from_file_location("tp_worker", path)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_two_ranks_generate_what_one_does(family):
    worker = _tp_worker()
    cfg = worker.with_biases(tiny(vocab_size=101) if family == "qwen3" else worker.configs()[family])
    # small biases: std 0.01 and up made these tiny random models repeat one token for every prompt
    model = Model(config=cfg, params=random_biases(init_params(cfg, seed=1), seed=2, std=0.005))
    one, one_logprobs = _staggered(model, 1)
    two, two_logprobs = _staggered(model, 2)
    assert two == one
    assert (two_logprobs - one_logprobs).abs().max() <= 1e-4
    assert len({len(o) for o in one}) == 1 and len(set(one)) == len(one)  # real, distinct generations


def test_killed_rank_fails_requests_with_its_name():
    cfg = tiny(vocab_size=101)
    model = Model(config=cfg, params=init_params(cfg, seed=1))
    engine = Engine(model, EngineConfig(compile=False, tensor_parallel_size=2, kv_budget_tokens=512, seed=0))
    try:
        assert isinstance(engine.runner, TPRunner)
        assert engine.submit([1, 2, 3], SamplingParams(max_tokens=2)).result().outputs  # the pair works
        handle = engine.submit([4, 5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
        time.sleep(0.3)  # decoding by now
        start = time.monotonic()
        os.kill(engine.runner.procs[0].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="rank 1"):
            handle.result()
        assert time.monotonic() - start < 30
        assert "rank 1" in engine.fatal
    finally:
        engine.shutdown()


def test_sizes_that_do_not_split_are_refused():
    cfg = tiny(vocab_size=101)
    with pytest.raises(ValueError, match="num_attention_heads"):
        Engine(Model(config=cfg, params=init_params(cfg)), EngineConfig(compile=False, tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_server_exits_with_the_error_when_a_rank_dies(tmp_path):
    model_dir = tiny_model_dir(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "astrai.cli.main", "serve", str(model_dir), "--port", str(port), "--no-compile",
            "--no-cuda-graphs", "-tp", "2", "--kv-budget", "512"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        body = {"model": "m", "prompt": "hello", "max_tokens": 3}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).status_code == 200
        pgrep = ["pgrep", "-P", str(proc.pid), "-f", "spawn_main"]  # the rank processes, not the resource tracker
        workers = subprocess.run(pgrep, capture_output=True, text=True).stdout.split()
        assert workers, "no rank process found"
        for pid in workers:
            os.kill(int(pid), signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, out  # the CLI's error status (`fail`)
    assert "the server stopped: tensor-parallel rank 1" in out, out
    assert "Traceback" not in out.split("the server stopped")[-1], out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_with_cuda_graphs_generate_what_one_does():
    cfg = tiny(vocab_size=101)
    model = Model(config=cfg, params=init_params(cfg, seed=1, device="cuda"))
    params = SamplingParams(max_tokens=10, temperature=0.0)
    outs = {}
    for tp in (1, 2):
        with Engine(model, EngineConfig(tensor_parallel_size=tp, kv_budget_tokens=256, seed=0)) as engine:
            outs[tp] = [engine.submit(p, params).result().outputs[0].token_ids for p in PROMPTS]
    assert outs[1] == outs[2]
