"""Tool-use rules that the OpenAI and Anthropic APIs share: tool names, the chat template's tool and tool-call
dicts, and the assistant-turn pre-fills that force a call.

Both APIs hand the chat template OpenAI-shaped dicts (that is what Hugging Face templates read), and both force a
tool call by pre-filling the assistant turn with the start of a Hermes `<tool_call>` that the model must finish;
`astrai.serve.tool_calls` parses the pre-fill as if the model had written it. Validation messages stay in each
API's own module, since each mimics its own service's wording.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # both services' rule for function names
FORCE_ANY = '<tool_call>\n{"name": "'  # the model must complete a call to some tool


def force_tool(name: str) -> str:
    """The assistant pre-fill that makes the model call `name` (it continues with the arguments object)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": '


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
