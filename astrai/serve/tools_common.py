"""Tool-use rules that the OpenAI and Anthropic APIs share: tool names and the chat template's tool and tool-call
dicts.

Both APIs hand the chat template OpenAI-shaped dicts (that is what Hugging Face templates read). Both constrain
tool calls with the same grammars (`tool_grammars.tool_call_grammar`). Validation messages stay in each API's own
module, since each mimics its own service's wording.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # both services' rule for function names


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool as the chat template takes it; absent fields are left out.

    Key order is OpenAI's (name, description, parameters): templates render these dicts as JSON, so the order
    reaches the prompt.
    """
    spec: dict[str, Any] = {"name": name}
    if description is not None:
        spec["description"] = description
    if parameters is not None:
        spec["parameters"] = parameters
    return {"type": "function", "function": spec}


def template_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's tool call as the chat template takes it (`arguments` an object, not JSON text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_names(tools: Iterable[dict[str, Any]]) -> tuple[str, ...]:
    """Function names of `function_tool` dicts, in order (the names the tool-call parser accepts)."""
    return tuple(t["function"]["name"] for t in tools)
