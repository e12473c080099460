# Sourced by the run_gpu*.sh scripts: environment, `$out`, `$py`, and `stage NAME TIMEOUT CMD...`, which runs a
# command with a time limit, logs it to $out/NAME.log, prints its tail and counts failures in `$failed`.
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_DEFAULT_FP_FUSION=1
py=${PYTHON:-python3}
failed=0
stage() {
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL_LINES:-25}" "$out/$name.log"
  echo "=== $name rc=$rc"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
