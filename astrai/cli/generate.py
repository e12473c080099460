"""`astrai generate MODEL --prompt TEXT`: complete one prompt, streaming text to the terminal."""

from __future__ import annotations

import sys

import attrs

from astrai.cli._common import ModelArgs, console, fail, interactive_engine, load_model, parse, run_guarded


@attrs.frozen(kw_only=True)
class GenerateConfig(ModelArgs):
    """Complete a prompt with a local model."""

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
    compile: bool = False
    """torch.compile the decode step, on CUDA the prefill step too (a one-off compile of tens of seconds on CPU)."""
    speculative_config: str | None = None
    """Speculative decoding, vLLM's JSON: '{"method": "ngram", "num_speculative_tokens": 4}' (the same text, fewer
    forwards when the output copies the prompt; docs/inference.md)."""


def stream_text(engine, prompt_ids: list[int], params) -> str:
    """Generate for one prompt on `engine`, printing text as it completes; returns the full text."""
    text = ""
    for delta in engine.stream(prompt_ids, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        text += delta.text
    sys.stdout.write("\n")
    return text


def main(cfg: GenerateConfig) -> None:
    """Load the model and stream a completion."""
    model = load_model(cfg)
    if model.tokenizer is None:
        fail(f"{cfg.model} has no tokenizer.json; astrai generate needs a tokenizer")
    tok = model.tokenizer
    if cfg.chat:
        ids = run_guarded(lambda: tok.apply_chat_template([{"role": "user", "content": cfg.prompt}], tokenize=True))
    else:
        ids = tok.encode_prompt(cfg.prompt)
    console.print(f"[dim]{len(ids)} prompt tokens[/]")
    from astrai.inference.params import SamplingParams

    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    with interactive_engine(model, cfg, compile=cfg.compile, speculative=cfg.speculative_config) as engine:
        run_guarded(lambda: stream_text(engine, ids, params))


if __name__ == "__main__":
    main(parse(GenerateConfig, prog="astrai generate"))
