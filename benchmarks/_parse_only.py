"""Run a benchmark script only as far as its argument parsing, then stop: the GPU scripts' dry run.

`python benchmarks/_parse_only.py benchmarks/bench_engine.py --device cuda ...` imports the script, runs its
`main` until `argparse` has parsed the flags, prints them and exits 0; a flag the script does not accept exits
2 with argparse's usage message, as the real run would. `_gpu_stage.sh` routes every benchmark stage here when
`ASTRAI_GPU_DRY_RUN=1`, so a typo in `run_gpu*.sh` shows on a CPU box in seconds instead of costing a stage of
the few device minutes a session gets (tests/benchmarks/test_gpu_scripts.py).
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path


class _Parsed(BaseException):
    """Raised from `parse_args` once the flags are parsed, to leave the script before it does any work (a
    BaseException, like SystemExit, so a script's own `except Exception` cannot swallow it and run on)."""


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: _parse_only.py SCRIPT [FLAGS...]", file=sys.stderr)
        return 2
    script = sys.argv[1]
    if not Path(script).is_file():
        print(f"_parse_only.py: no such script: {script}", file=sys.stderr)
        return 2
    parse_args = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_and_stop
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    except _Parsed as parsed:
        print(f"{script}: flags parse: {vars(parsed.args[0])}")
        return 0
    print(f"{script}: finished without parsing any flags", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
