"""`astrai chat MODEL`: a multi-turn terminal chat through the model's chat template (or `--chat-template`).

Type a message and press enter; `/reset` clears the history, `/exit` (or end of input) quits.
"""

from __future__ import annotations

import sys

import attrs

from astrai.cli._common import ModelArgs, console, fail, interactive_engine, load_model, parse, run_guarded
from astrai.cli.generate import stream_text
from astrai.inference.params import SamplingParams


@attrs.frozen(kw_only=True)
class ChatConfig(ModelArgs):
    """Chat with a local model in the terminal."""

    system: str | None = None
    """Optional system prompt."""
    max_tokens: int = 256
    """Most new tokens per reply."""
    temperature: float = 0.7
    """0 for greedy decoding."""
    top_p: float = 0.95
    """Nucleus mass (1: off)."""
    compile: bool = False
    """torch.compile the decode step, and on CUDA the prefill step (faster replies after a one-off compile)."""
    speculative_config: str | None = None
    """Speculative decoding, vLLM's JSON: '{"method": "ngram", "num_speculative_tokens": 4}' (the same text, fewer
    forwards when the output copies the prompt; docs/inference.md)."""


def main(cfg: ChatConfig) -> None:
    """Read user turns from stdin and stream the model's replies."""
    model = load_model(cfg)
    if model.tokenizer is None or model.tokenizer.chat_template is None:
        fail(f"{cfg.model} has no tokenizer chat template; pass --chat-template or use `astrai generate`")
    history: list[dict] = [{"role": "system", "content": cfg.system}] if cfg.system else []
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p)
    console.print("[dim]astrai chat: /reset clears the history, /exit quits[/]")
    with interactive_engine(model, cfg, compile=cfg.compile, speculative=cfg.speculative_config) as engine:
        while True:
            console.print("[bold green]you>[/] ", end="")
            line = sys.stdin.readline()
            if not line or line.strip() == "/exit":
                return
            text = line.rstrip("\n")
            if text.strip() == "/reset":
                history = history[:1] if cfg.system else []
                continue
            history.append({"role": "user", "content": text})
            ids = run_guarded(lambda h=history: model.tokenizer.apply_chat_template(h, tokenize=True))
            console.print("[bold blue]model>[/] ", end="")
            reply = run_guarded(lambda ids=ids: stream_text(engine, ids, params))
            history.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    main(parse(ChatConfig, prog="astrai chat"))
