#!/usr/bin/env bash
# One prepared GPU check of issue 43 (speculative decoding), run on a CUDA machine from the repo root in <= 9
# minutes (its stage timeouts add up to 540 s): bench_spec on CUDA, each row the same engine with and without
# speculation, alternating, outputs checked token-identical (the script exits 1 otherwise).
# 1. SmolLM2-135M shape, random weights, bf16, batch 1: the 7-block prefix draft (synthetic: its guesses pass; the
#    draft machinery on a bandwidth-bound target) and n-gram on an output that repeats itself (the upper bound).
# 2. The trained edit model and its distilled draft, fp32, batch 1: n-gram and the draft (issue 43's CPU pair).
#    Needs runs/spec_edit/model and runs/spec_edit/draft from this checkout (the device tool's `carry`; ~4 MB);
#    without them the stage would train the model first, so it is skipped.
# Logs and JSON go to ${OUT:-benchmarks/results}. Stages are independent.
set -u
TAIL_LINES=30
source "$(dirname "$0")/_gpu_stage.sh"
banner
stage spec_135m "${SPEC_135M_TIMEOUT:-330}" $py benchmarks/bench_spec.py --device cuda --dtype bfloat16 \
  --workloads prefix-draft repeat --batch 1 --rounds 3 --out "$out/gpu_bench_spec_135m.json"
if [ -f runs/spec_edit/model/config.json ] && [ -f runs/spec_edit/draft/config.json ] || [ "$dry" = 1 ]; then
  stage spec_edit "${SPEC_EDIT_TIMEOUT:-210}" $py benchmarks/bench_spec.py --device cuda --workloads edit edit-draft \
    --edit-dir runs/spec_edit --batch 1 --rounds 3 --out "$out/gpu_bench_spec_edit.json"
else
  echo "spec_edit skipped: no runs/spec_edit/model and runs/spec_edit/draft (carry them)"
fi
echo "failed stages: $failed"
exit "$failed"
