"""Makes this folder's helper modules (`_attn_cases`, `_cuda_sim`) importable from its tests.

`tests/cuda_ref` cannot be imported as a package: the real top-level `cuda_ref` package shadows it, and tests
run with `--import-mode=importlib`, which puts no test folder on `sys.path`.
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
