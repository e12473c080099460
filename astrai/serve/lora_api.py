"""Multi-LoRA serving's HTTP side (issue 44), in vLLM's shapes: the adapters' model cards, a request's `model`
naming an adapter, the runtime load / unload routes and the adapter metrics.

- `/v1/models` lists each loaded adapter after the base model: `id` the adapter's name, `parent` the base model's
  served name (or the `base_model_name` its `--lora-modules` entry gave), `root` the adapter's folder (vLLM's card).
- A request's `model` naming an adapter runs it with that adapter (`ServerState.check_model` returns its name; the
  routes pass it to `Engine.submit(..., lora=name)` and echo it as the reply's `model`); the base model's names run
  the base; any other name is a 404 `model_not_found`.
- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}` exist
  only when the server was started with `--enable-lora-runtime-updates` (else 404, as vLLM without
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING`). Both are under /v1/, so the API key guards them. Success is vLLM's plain
  text (`Success: LoRA adapter 'x' added successfully.`); a name loaded twice or a bad folder is a 400, an
  unknown name on unload (or a folder that does not exist on load) a 404. With `--lora-root` a load may only read
  under that folder: the path (relative paths are taken from the root) and the adapter files in it are resolved,
  symlinks followed, and one that lands outside is a 400 naming the root. The folder is checked and read on a
  worker thread (`ServerState.offload`), never on the event loop. Unloading lets the requests already running
  with the adapter finish (the engine frees its slot after the last one); new requests naming it are 404s at once.
- Metrics (`lora_lines`): `astrai_lora_adapters_loaded`, `astrai_lora_running_requests{adapter}` and
  `astrai_lora_waiting_requests{adapter}` (one series per loaded adapter), and vLLM's `vllm:lora_requests_info`
  (value: the current time; labels `max_lora` and the comma-joined `running_lora_adapters` /
  `waiting_lora_adapters`), which the Gateway API inference extension's endpoint picker reads.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from astrai.inference.engine import EngineStats
from astrai.inference.errors import LoRAError, LoRANotFoundError
from astrai.io.lora import ADAPTER_FOLDER_ENTRIES
from astrai.serve.common import APIError, json_body, openai_error, route
from astrai.serve.prometheus import escape_label, family, number
from astrai.serve.state import ServerState


def adapter_cards(state: ServerState) -> list[dict[str, Any]]:
    """vLLM's model card of each loaded adapter, in load order."""
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "astrai", "root": path,
             "parent": state.lora_parents.get(name, state.model_name), "max_model_len": state.context}
            for name, path in state.adapters().items()]  # fmt: skip


def _name_field(body: Mapping[str, Any], message: str) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise APIError(400, message, param="lora_name")
    return name


def resolve_under(root: Path | None, lora_path: str) -> Path:
    """The folder a load reads: `lora_path` (relative: from `root`, else from the working directory) with its
    symlinks resolved; with a `root`, it and each adapter file in it must lie under the (resolved) root.

    Raises:
        APIError: 400 for a path outside the root (naming the root), 404 for a folder that does not exist.
    """
    try:
        folder = ((Path(root) if root is not None else Path.cwd()) / lora_path).resolve()
        top = None if root is None else Path(root).resolve()
        inside = [folder, *((folder / f).resolve() for f in ADAPTER_FOLDER_ENTRIES)]
        is_dir = folder.is_dir()
    except (OSError, ValueError, RuntimeError) as err:  # a NUL byte, a symlink loop, a name too long
        raise APIError(400, f"lora_path {lora_path[:300]!r} is not a usable path: {err}", param="lora_path") from None
    if top is not None and not all(p == top or p.is_relative_to(top) for p in inside):
        raise APIError(400, f"lora_path {lora_path[:300]!r} is outside the LoRA root {str(top)!r} (--lora-root): "
                            "only adapters under it can be loaded", param="lora_path")  # fmt: skip
    if not is_dir:
        raise APIError(404, f"No adapter found for {lora_path[:300]!r}: no such folder", param="lora_path",
                       code="adapter_not_found", type="not_found_error")  # fmt: skip
    return folder


def _load(state: ServerState, name: str, lora_path: str) -> None:
    """Check the folder and load it into the engine (on a worker thread: it reads and validates the files)."""
    folder = resolve_under(state.lora_root, lora_path)
    try:
        state.engine.load_lora(name, folder)
    except (ValueError, OSError) as err:  # LoRAError: bad folder, rank, targets, shapes, a name taken meanwhile
        param = err.param if isinstance(err, LoRAError) and err.param else "lora_path"
        raise APIError(400, f"LoRA adapter {name[:200]!r}: {err}", param=param) from None


def routes(state: ServerState) -> list[Route]:
    """The runtime load / unload routes (none unless `state.lora_runtime_updates`)."""
    if not state.lora_runtime_updates:
        return []

    async def load(request: Request) -> Response:
        body = await json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           param="lora_path" if isinstance(name, str) and name else "lora_name")  # fmt: skip
        if name == state.model_name or name in state.model_aliases:
            raise APIError(400, f"lora_name {name[:200]!r} is the base model's name: give the adapter another",
                           param="lora_name")  # fmt: skip
        if name in state.adapters():
            raise APIError(400, f"The lora adapter '{name[:200]}' has already been loaded.", param="lora_name")
        await state.offload(_load, state, name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: Request) -> Response:
        name = _name_field(await json_body(request), "either 'lora_name' and 'lora_int_id' needs to be provided.")
        try:
            await state.offload(state.engine.unload_lora, name)
        except LoRANotFoundError:
            raise APIError(404, f"The lora adapter '{name[:200]}' cannot be found.", param="lora_name",
                           type="not_found_error", code="adapter_not_found") from None  # fmt: skip
        state.lora_parents.pop(name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return [Route("/v1/load_lora_adapter", route(openai_error, load), methods=["POST"]),
            Route("/v1/unload_lora_adapter", route(openai_error, unload), methods=["POST"])]  # fmt: skip


def lora_lines(stats: EngineStats, loaded: list[str], max_loras: int) -> list[str]:
    """The LoRA metric families' exposition lines: `loaded` are the loaded adapters' names (each gets its series,
    0 when idle; an unloaded adapter still finishing its requests keeps its series until they end)."""
    running, waiting = dict(stats.lora_running), dict(stats.lora_waiting)
    names = list(dict.fromkeys([*loaded, *running, *waiting]))
    lines = family("astrai_lora_adapters_loaded", "gauge", "LoRA adapters loaded (servable by name).",
                   [f"astrai_lora_adapters_loaded {number(stats.lora_loaded)}"])  # fmt: skip
    for metric, counts, doc in (
        ("astrai_lora_running_requests", running, "Sequences running, per LoRA adapter."),
        ("astrai_lora_waiting_requests", waiting, "Sequences queued, per LoRA adapter."),
    ):
        lines += family(metric, "gauge", doc, [f'{metric}{{adapter="{escape_label(n)}"}} {counts.get(n, 0)}'
                                               for n in names])  # fmt: skip
    active = ",".join(n for n in names if running.get(n))
    queued = ",".join(n for n in names if waiting.get(n))
    labels = (f'max_lora="{max_loras}",running_lora_adapters="{escape_label(active)}",'
              f'waiting_lora_adapters="{escape_label(queued)}"')  # fmt: skip
    lines += family("vllm:lora_requests_info", "gauge", "Running stats on lora requests.",
                    [f"vllm:lora_requests_info{{{labels}}} {number(time.time())}"])  # fmt: skip
    return lines
