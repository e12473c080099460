"""The engine's LoRA-adapter methods (multi-LoRA serving): a mixin of `Engine`, apart from engine.py's request and
step machinery. The adapter slots and their cache are `astrai.inference.adapters`; `Engine.__init__` sets
`self.adapters` (None unless `EngineConfig.enable_lora`)."""

from __future__ import annotations

import contextlib
import os

from astrai.inference.adapters import Adapters
from astrai.inference.errors import LoRAError
from astrai.io.model import Model


class LoRAMethods:
    """`Engine.load_lora`, `unload_lora`, `loras` and `lora_model`."""

    adapters: Adapters | None
    model: Model

    def load_lora(self, name: str, path: str | os.PathLike) -> None:
        """Read the PEFT adapter folder `path` (on this thread) and serve it as `name` (`submit(lora=name)`).

        Raises:
            LoRAError: LoRA serving is off, the name is taken, or the folder is missing, half-written, for
                another base model, targets projections the base lacks or has a rank above `max_lora_rank`.
        """
        self._lora_on("lora_name").load(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving `name`: new requests cannot name it; those already submitted finish with it."""
        self._lora_on("lora_name").unload(name)

    def loras(self) -> dict[str, str]:
        """Loaded adapter name -> folder, in load order."""
        return self.adapters.loaded() if self.adapters is not None else {}

    def lora_model(self, name: str | None) -> contextlib.AbstractContextManager[Model]:
        """`with engine.lora_model(name) as model:` the model with adapter `name` applied (the base model for None),
        for work outside the engine's steps (prompt scoring); the adapter stays loaded until the block ends."""
        if name is None:
            return contextlib.nullcontext(self.model)
        return self._lora_on("model").applied(name, self.model)

    def _lora_on(self, param: str) -> Adapters:
        if self.adapters is None:
            raise LoRAError("this engine serves no LoRA adapters: start it with EngineConfig(enable_lora=True) "
                            "(astrai serve --enable-lora)", param=param)  # fmt: skip
        return self.adapters
