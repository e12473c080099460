"""`astrai generate --model DIR --prompt TEXT`: complete one prompt, streaming text to the terminal."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import tyro

from astrai.cli._common import console, fail, load_model, run_guarded


@attrs.frozen(kw_only=True)
class GenerateConfig:
    """Complete a prompt with a local model."""

    model: Path
    """HF-format model folder."""
    prompt: str
    """Text to complete."""
    chat: bool = False
    """Wrap the prompt as a user message with the model's chat template."""
    max_tokens: int = 64
    """Most new tokens."""
    temperature: float = 0.0
    """0 for greedy decoding."""
    top_k: int = 0
    """Sample from the k most likely tokens (0: off)."""
    top_p: float = 1.0
    """Nucleus mass (1: off)."""
    seed: int | None = None
    """Seed for reproducible sampling."""
    dtype: str | None = None
    """Parameter dtype (float32, bfloat16, float16); default: the checkpoint's."""
    device: str | None = None
    """Device, e.g. cuda or cpu; default cpu."""


def stream_text(model, prompt_ids: list[int], **sampling) -> str:
    """Generate for one prompt, printing text as it completes; returns the full text."""
    from astrai.inference.generate import stream_ids

    detok = model.tokenizer.detokenizer()
    stops = set(model.eos_token_ids)
    for _, token, done in stream_ids(model, [prompt_ids], **sampling):
        if not (done and token in stops):
            sys.stdout.write(detok.add(token))
            sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    return detok.text


def main(cfg: GenerateConfig) -> None:
    """Load the model and stream a completion."""
    model = load_model(cfg.model, cfg.dtype, cfg.device)
    if model.tokenizer is None:
        fail(f"{cfg.model} has no tokenizer.json; astrai generate needs a tokenizer")
    tok = model.tokenizer
    if cfg.chat:
        ids = run_guarded(lambda: tok.apply_chat_template([{"role": "user", "content": cfg.prompt}], tokenize=True))
    else:
        ids = tok.encode(cfg.prompt)
    console.print(f"[dim]{len(ids)} prompt tokens[/]")
    sampling = dict(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    run_guarded(lambda: stream_text(model, ids, seed=cfg.seed, **sampling))


if __name__ == "__main__":
    main(tyro.cli(GenerateConfig))
