# Sourced by the run_gpu*.sh scripts: environment, `$out`, `$py`, `banner`, and `stage NAME TIMEOUT CMD...`, which
# runs a command with a time limit, logs it to $out/NAME.log, prints its tail and counts failures in `$failed`.
#
# ASTRAI_GPU_DRY_RUN=1 checks a script on any machine, no GPU needed, before device time is spent on it: each stage
# only checks its command. A pytest stage collects its selection (`--collect-only`: a path that is gone, or a -k/-m
# that selects nothing, fails; pytest exits 5 on an empty selection), a benchmark stage parses its flags and stops
# (benchmarks/_parse_only.py), and any other command is reported unchecked. tests/benchmarks/test_gpu_scripts.py
# dry-runs every script.
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_DEFAULT_FP_FUSION=1
py=${PYTHON:-python3}
case "${ASTRAI_GPU_DRY_RUN:-0}" in 1 | true | yes | on) dry=1 ;; *) dry=0 ;; esac
failed=0

# the GPU, driver and library versions at the top of a log (skipped in a dry run: there may be no GPU)
banner() {
  [ "$dry" = 1 ] && { echo "dry run: checking each stage's command only"; return; }
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
}

# the dry run's stand-in for a stage's command, in the array `checked` (empty: nothing to check)
dry_command() {
  checked=()
  local arg rewritten=0
  for arg in "$@"; do
    if [ "$rewritten" = 0 ] && [[ $arg == benchmarks/*.py ]]; then
      checked+=("benchmarks/_parse_only.py" "$arg")
      rewritten=1
    else
      checked+=("$arg")
    fi
  done
  if [[ " $* " == *" pytest "* ]]; then
    checked+=(--collect-only)
  elif [ "$rewritten" = 0 ]; then
    checked=()
  fi
}

stage() {
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  if [ "$dry" = 1 ]; then
    dry_command "$@"
    if [ "${#checked[@]}" -eq 0 ]; then
      echo "=== $name: not checked in a dry run: $*"
      return
    fi
    set -- "${checked[@]}"
  fi
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL_LINES:-25}" "$out/$name.log"
  echo "=== $name rc=$rc"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
