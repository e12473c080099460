#!/usr/bin/env bash
# One prepared GPU check of issue 16 (performance), run on a CUDA machine from the repo root in <= 10 minutes
# (its stage timeouts add up to 590 s):
# first the start checks of the GPU fast paths no GPU run has confirmed (check_fast_paths.py: the fused rotary + KV
# store, the tuned launch, fused projections, the compiled prefill, each against its confirmed path; its JSON's
# `records` are what astrai/inference/fast_paths.py and docs/inference.md's table take once every check passed),
# the long-context compiled decode-attention test (autotuning on, which run_gpu.sh's `-k "not compile"` skips),
# the compiled-prefill and overlap-schedule tests on CUDA (compiled prefill is on by default there, measured only
# on CPU so far; the overlap test checks that launching a decode step never syncs the host), the fused MoE kernel
# (sync-free experts: DeepSeek-shaped MLA + MoE engines now capture CUDA graphs),
# the step profile (profile_step.py: a decode step and mixed steps through the compiled and the eager prefill
# under torch.profiler, Chrome traces kept; at 128 new tokens also with the autotuned kernels launched through
# the autotuner's per-call lookup, against triton_kernels/_launch.py's remembered configs), batch-1 decode steps with fused projections on and off (ms, kernels per
# step), the
# engine benchmark in bf16 (CUDA graphs on and off, overlap schedule on and off) and nano-vllm's serving workload (bench_throughput --preset
# gpu, one timed repeat). Logs, JSON and traces go to ${OUT:-benchmarks/results}. Stages are independent.
set -u
TAIL_LINES=30
source "$(dirname "$0")/_gpu_stage.sh"
banner
stage fast_paths "${FAST_PATHS_TIMEOUT:-45}" $py benchmarks/check_fast_paths.py --device cuda --out "$out/fast_paths.json"
stage decode_attention_autotuned "${ATTN_TIMEOUT:-60}" env ASTRAI_TRITON_AUTOTUNE=1 $py -m pytest -q -p no:cacheprovider \
  -W ignore::DeprecationWarning tests/triton_kernels/test_decode_attention.py -k "compiled_gpu"
stage compiled_prefill_gpu "${PREFILL_TIMEOUT:-100}" $py -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
  tests/astrai/inference/test_compiled_prefill.py tests/astrai/inference/test_engine.py tests/astrai/inference/test_fuse_engine.py \
  tests/astrai/inference/test_overlap.py tests/astrai/models/test_deepseek_parity.py tests/triton_kernels/test_fused_moe.py \
  -k "compiled or prefill or cuda or overlap"
stage profile_step "${PROFILE_TIMEOUT:-70}" $py benchmarks/profile_step.py --device cuda --trace-dir "$out/traces" \
  --tuner-launch-at 128 --out "$out/h200_profile_step.json"
for fuse in on off; do  # issue 16 item 1: batch-1 decode with q/k/v and gate/up fused (the CUDA default) or apart
  stage "decode_fusion_$fuse" "${FUSION_TIMEOUT:-40}" $py benchmarks/profile_step.py --device cuda --rows 1 --prefill 128 \
    --eager-prefill --warmup 2 --repeats 9 --fuse-projections "$fuse" --out "$out/h200_profile_decode_fused_$fuse.json"
done
stage bench_engine_gpu "${ENGINE_TIMEOUT:-140}" $py benchmarks/bench_engine.py --device cuda --dtype bfloat16 --overlap \
  --out "$out/h200_bench_engine.json"
stage bench_throughput_gpu "${THROUGHPUT_TIMEOUT:-95}" $py benchmarks/bench_throughput.py --preset gpu --repeats 1 \
  --out "$out/h200_bench_throughput.json"
echo "failed stages: $failed"
exit "$failed"
