#!/usr/bin/env bash
# One prepared GPU check of the training stack (run on a CUDA machine from the repo root): the GPU train-step
# tests (compiled step on CUDA vs the eager CPU step, fp32 and bf16 autocast) and the quickstart end to end.
# Logs go to ${OUT:-benchmarks/results}. Stages are independent. Exit status: number of failed stages.
set -u
TAIL_LINES=30
source "$(dirname "$0")/_gpu_stage.sh"
banner
stage train_step_gpu "${TRAIN_TESTS_TIMEOUT:-90}" $py -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
  -m gpu tests/astrai/train/test_step.py
stage quickstart_gpu "${QUICKSTART_TIMEOUT:-150}" bash -c "time $py -m astrai.cli.main quickstart --out-dir /tmp/qs_gpu --retrain"
echo "failed stages: $failed"
exit "$failed"
