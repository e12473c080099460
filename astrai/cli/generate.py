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
    device: str = "auto"
    """Device: auto (CUDA when available, else CPU), cuda, cuda:N or cpu."""
    compile: bool = False
    """torch.compile the decode step (faster decode after a one-off compile of tens of seconds on CPU)."""


def stream_text(engine, prompt_ids: list[int], params) -> str:
    """Generate for one prompt on `engine`, printing text as it completes; returns the full text."""
    text = ""
    for delta in engine.stream(prompt_ids, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        text += delta.text
    sys.stdout.write("\n")
    return text


def make_engine(model, compile: bool):
    """A small engine for interactive use (a 1-sequence batch)."""
    from astrai.inference.engine import Engine, EngineConfig

    return Engine(model, EngineConfig(max_running=4, compile=compile, kv_budget_bytes=256 << 20))


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
    from astrai.inference.params import SamplingParams

    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                            seed=cfg.seed)  # fmt: skip
    with make_engine(model, cfg.compile) as engine:
        run_guarded(lambda: stream_text(engine, ids, params))


if __name__ == "__main__":
    main(tyro.cli(GenerateConfig))
