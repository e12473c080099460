"""astrai: a hackable, functional-style LLM stack in plain PyTorch.

Models are pure functions over attrs parameter trees; see SPEC §1 for the public API.

Besides the re-exports, two things run here. First, before anything imports torch, astrai's OpenMP wait setting
(`astrai.openmp`: a short GOMP_SPINCOUNT, so CPU decode gives a shared core back quickly; a user's own setting wins).
Second, in a source checkout used without installing (`PYTHONPATH=.`, the
GPU check scripts), the repo's top-level folders triton_kernels/, cuda_ref/, cpu_kernels/, configs/ and
quickstart/ become importable as `astrai.triton_kernels` and so on, the names pyproject's package-dir gives them
in an install
(docs/architecture.md). An installed astrai has no pyproject.toml beside it, so nothing changes there.
"""

from pathlib import Path as _Path

from astrai.openmp import set_default_spin_count as _set_default_spin_count

_set_default_spin_count()  # before the imports below load torch (and its OpenMP runtime)

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "triton_kernels" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__): astrai.<folder> -> <checkout>/<folder>

from astrai.api import embed as embed  # noqa: E402
from astrai.api import embed_ids as embed_ids  # noqa: E402
from astrai.api import forward as forward  # noqa: E402
from astrai.inference.chat import chat as chat  # noqa: E402
from astrai.inference.engine_cache import release_engines as release_engines  # noqa: E402
from astrai.inference.generate import generate as generate  # noqa: E402
from astrai.inference.generate import generate_ids as generate_ids  # noqa: E402
from astrai.io.errors import CheckpointError as CheckpointError  # noqa: E402
from astrai.io.errors import UnsupportedModelError as UnsupportedModelError  # noqa: E402
from astrai.io.model import Model as Model  # noqa: E402
from astrai.io.model import load as load  # noqa: E402
from astrai.io.model import save as save  # noqa: E402
from astrai.io.tokenizer import Tokenizer as Tokenizer  # noqa: E402
from astrai.models.config import ModelConfig as ModelConfig  # noqa: E402
from astrai.models.decoder import init_params as init_params  # noqa: E402

__version__ = "0.1.0"
