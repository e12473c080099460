"""astrai: a hackable, functional-style LLM stack in plain PyTorch.

Models are pure functions over attrs parameter trees; see SPEC §1 for the public API.
"""

from astrai.api import embed as embed
from astrai.api import embed_ids as embed_ids
from astrai.api import forward as forward
from astrai.inference.generate import generate as generate
from astrai.inference.generate import generate_ids as generate_ids
from astrai.io.errors import CheckpointError as CheckpointError
from astrai.io.errors import UnsupportedModelError as UnsupportedModelError
from astrai.io.model import Model as Model
from astrai.io.model import load as load
from astrai.io.model import save as save
from astrai.io.tokenizer import Tokenizer as Tokenizer
from astrai.models.config import ModelConfig as ModelConfig
from astrai.models.decoder import init_params as init_params

__version__ = "0.1.0"
