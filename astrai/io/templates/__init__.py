"""Bundled chat templates for models astrai trains itself (the quickstart and demos).

`chatml.jinja` is ChatML with tool calling in Qwen2.5's layout (`<tool_call>{json}</tool_call>`).
"""

from __future__ import annotations

from importlib import resources


def chatml_template() -> str:
    """The bundled ChatML-with-tools jinja2 template."""
    return resources.files(__package__).joinpath("chatml.jinja").read_text(encoding="utf-8")
