"""One engine of `bench_cpu_peers` in a process of its own: astrai, llama.cpp (llama-cpp-python) or vLLM's CPU build.

Run with the Python of the venv that holds the engine (vLLM's CPU build pins its own torch, llama-cpp-python builds
its own llama.cpp), so this file imports nothing of astrai's at module level and nothing of the benchmarks'. The
parent starts it once per engine and model, then sends one JSON command per line on stdin and reads one JSON reply
per line on stdout, so the rounds can alternate between engines without paying a start-up (or a compile) per round:

    {"op": "generate", "prompts": [[ids], ...], "new": 128}  ->  {"seconds": s, "tokens": [[ids], ...]}
    {"op": "quit"}

`generate` runs every prompt at once (the engine's own batching; llama.cpp, which batches sequences only in its
server, runs them one after another), greedy, exactly `new` tokens each (end-of-sequence ignored), and times the
whole call: prompt, decode and the engine's per-call overhead, on the path a user of that engine takes.

    python cpu_peer_worker.py astrai FOLDER --dtype float32|bfloat16 [--quantize int8] --threads 2 [--fixed-threads]
    python cpu_peer_worker.py llama FILE.gguf --threads 2 --max-len 256 [--no-extra-buffers]
    python cpu_peer_worker.py vllm FOLDER --dtype float32|bfloat16 --max-len 256   (threads: VLLM_CPU_OMP_THREADS_BIND)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


class AstraiEngine:
    """`astrai.generate_ids`: the notebook path (one cached, compiled engine per model)."""

    def __init__(self, folder: str, dtype: str, quantize: str | None, threads: int, fixed_threads: bool) -> None:
        import torch

        import astrai
        from astrai.inference import engine_cache

        if fixed_threads:
            engine_cache.SHARE_CPU_CORES = False
        torch.set_num_threads(threads)
        self.astrai = astrai
        self.model = astrai.load(folder, dtype=dtype, quantize=quantize)

    def generate(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        return self.astrai.generate_ids(self.model, prompts, max_tokens=new, stop_token_ids=[])


class LlamaEngine:
    """llama-cpp-python's `Llama`: `eval` (llama_decode) of the prompt, then one token per `eval`, argmax on the
    host with numpy: the lightest loop its Python API allows (no sampler chain), so the figure is llama.cpp's."""

    def __init__(self, path: str, threads: int, max_len: int, extra_buffers: bool) -> None:
        import llama_cpp.llama_cpp as low_level
        import numpy as np
        from llama_cpp import Llama

        if not extra_buffers:  # llama_model_params.use_extra_bufts = false (llama.cpp's --no-repack)
            defaults = low_level.llama_model_default_params

            def without_extra_buffers():
                params = defaults()
                params.use_extra_bufts = False
                return params

            low_level.llama_model_default_params = without_extra_buffers  # what `Llama` calls

        self.np = np
        self.llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=max_len, n_batch=512,
                         n_ubatch=512, logits_all=False, verbose=False)  # fmt: skip
        self.vocab = self.llm.n_vocab()

    def generate(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        out = []
        for prompt in prompts:
            self.llm.reset()
            self.llm.eval(prompt)
            tokens: list[int] = []
            while True:  # the last evaluated token's logits, read in place (llama_get_logits)
                logits = self.np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab,))
                token = int(self.np.argmax(logits))
                tokens.append(token)
                if len(tokens) == new:
                    break
                self.llm.eval([token])
            out.append(tokens)
        return out


class VllmEngine:
    """vLLM's offline `LLM.generate` over token-id prompts (its continuous batching, its CPU attention)."""

    def __init__(self, folder: str, dtype: str, max_len: int) -> None:
        from vllm import LLM, SamplingParams

        self.sampling = SamplingParams
        self.llm = LLM(model=folder, dtype=dtype, max_model_len=max_len, max_num_seqs=64, seed=0,
                       enable_prefix_caching=False)  # fmt: skip

    def generate(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        params = self.sampling(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["astrai", "llama", "vllm"])
    parser.add_argument("path", help="the HF folder (astrai, vllm) or the GGUF file (llama)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=512, help="longest prompt + output (context size)")
    parser.add_argument(
        "--fixed-threads",
        action="store_true",
        help="astrai: EngineConfig(share_cpu_cores=False), steps on every thread even beside a busy program",
    )
    parser.add_argument(
        "--no-extra-buffers",
        action="store_true",
        help="llama.cpp: no extra weight buffers (on x86 only AMX's repacked weights use them)",
    )
    args = parser.parse_args(argv)
    # the replies get a descriptor of their own; fd 1 becomes stderr, so the engines' prints (and those of the
    # processes they start, which inherit fd 1) never reach the reply stream
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if args.kind == "astrai":
        engine = AstraiEngine(args.path, args.dtype, args.quantize, args.threads, args.fixed_threads)
    elif args.kind == "llama":
        engine = LlamaEngine(args.path, args.threads, args.max_len, not args.no_extra_buffers)
    else:
        engine = VllmEngine(args.path, args.dtype, args.max_len)
    print(json.dumps({"ready": True, "pid": os.getpid()}), file=reply, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        start = time.perf_counter()
        tokens = engine.generate(command["prompts"], command["new"])
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "tokens": tokens}), file=reply, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
