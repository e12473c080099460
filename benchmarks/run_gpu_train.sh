#!/usr/bin/env bash
# One prepared GPU check of the training stack (run on a CUDA machine from the repo root): the GPU train-step
# tests (compiled step on CUDA vs the eager CPU step, fp32 and bf16 autocast) and the quickstart end to end.
# Logs go to ${OUT:-benchmarks/results}. Stages are independent. Exit status: number of failed stages.
set -u
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_DEFAULT_FP_FUSION=1
py=${PYTHON:-python3}
failed=0
stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 30 "$out/$name.log"
  echo "=== $name rc=$rc"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
$py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
stage train_step_gpu "${TRAIN_TESTS_TIMEOUT:-90}" $py -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
  -m gpu tests/astrai/train/test_step.py
stage quickstart_gpu "${QUICKSTART_TIMEOUT:-150}" bash -c "time $py -m astrai.cli.main quickstart --out-dir /tmp/qs_gpu --retrain"
echo "failed stages: $failed"
exit "$failed"
