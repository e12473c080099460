"""The fields routers add to every chat and completion body they forward (`router_api`), folded into astrai's:
SGLang's `no_stop_trim`, `separate_reasoning`, `stream_reasoning`, `return_hidden_states` (sglang-router and
vllm-router add them) and vLLM's `include_reasoning` (vllm-router, chat).

Their default values are what astrai does anyway and are dropped; `no_stop_trim: true` is vLLM's
`include_stop_str_in_output: true`; any other value astrai cannot honour is a 400 naming the field, so nothing a
client sends is silently ignored.
"""

from __future__ import annotations

from typing import Any

from astrai.serve.sampling_fields import bad, flag

# field -> (default, why another value is refused); None: every value is accepted (`no_stop_trim` maps to
# include_stop_str_in_output)
ROUTER_FIELDS: dict[str, tuple[bool, str | None]] = {
    "no_stop_trim": (False, None),
    "separate_reasoning": (True, "reasoning is split off the answer exactly when the server runs with "
                                 "--reasoning-parser"),
    "stream_reasoning": (True, "reasoning is streamed as it is generated"),
    "return_hidden_states": (False, "hidden states are not returned"),
    "include_reasoning": (True, "the reasoning a --reasoning-parser splits off is always returned"),
}  # fmt: skip


def router_fields(body: dict[str, Any]) -> None:
    """Fold the routers' fields of a chat or completion `body` into astrai's, in place (removed); a value astrai
    cannot honour is a 400 naming the field. A body without them is left as it is (one set test)."""
    if not body.keys() & ROUTER_FIELDS.keys():
        return
    for key, (default, refusal) in ROUTER_FIELDS.items():
        if key not in body:
            continue
        value = flag(body, key, default)  # a boolean or null, else 400
        del body[key]
        if key == "no_stop_trim":
            if value:  # keep the stop string in the text: vLLM's include_stop_str_in_output
                body["include_stop_str_in_output"] = True
        elif value != default:
            raise bad(key, f"{key} {str(value).lower()} is not supported by this server ({refusal})")
