#!/usr/bin/env bash
# One prepared GPU check of the inference engine (run on a CUDA machine from the repo root): the engine tests on
# CUDA (Triton kernels; decode replayed from CUDA graphs, eager and compiled, and without graphs), the GPU tests of
# the sampler, the DeepSeek engine (MLA decode kernel, MoE) and the MLA kernel, then bench_engine on CUDA in bf16
# with CUDA graphs on and off. Logs and JSON go to ${OUT:-benchmarks/results}. Stages are independent.
set -u
TAIL_LINES=30
source "$(dirname "$0")/_gpu_stage.sh"
banner
pytest_gpu=(env ASTRAI_TRITON_AUTOTUNE=0 $py -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning --durations=6)
stage engine_tests "${ENGINE_TESTS_TIMEOUT:-200}" "${pytest_gpu[@]}" tests/astrai/inference/test_engine.py \
  tests/astrai/inference/test_sampler.py::test_noise_and_tokens_are_the_same_on_cuda
stage mla_tests "${MLA_TESTS_TIMEOUT:-120}" "${pytest_gpu[@]}" tests/astrai/models/test_deepseek_parity.py \
  tests/triton_kernels/test_mla_decode.py -k "cuda_engine or (test_matches_ref and not float32) or (compiled_gpu and bfloat16)"
stage bench_engine_gpu "${BENCH_TIMEOUT:-200}" $py benchmarks/bench_engine.py --device cuda --dtype bfloat16 \
  --out "$out/h200_bench_engine.json"
echo "failed stages: $failed"
exit "$failed"
