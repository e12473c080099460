"""`python -m astrai.cli.demo`: the README's `make run` until the quickstart (training) lands.

An honest end-to-end tour on a tiny *random* model: trains a small tokenizer locally, builds a random
Qwen3-shaped decoder, saves it as a Hugging Face folder, reloads it, checks the reloaded logits equal the
originals, prints `astrai info`, and streams a generation. The text is gibberish because the weights are
random; the point is that every stage runs with no downloads.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch
import tyro

from astrai.cli import generate, info
from astrai.cli._common import console
from astrai.io.model import Model, load, save
from astrai.io.templates import chatml_template
from astrai.io.tokenizer import train_tokenizer
from astrai.models.decoder import forward, init_params
from configs.models import tiny

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "astrai is a hackable LLM stack in plain PyTorch: models are pure functions over parameter trees.",
    "Attention is all you need; rotary embeddings encode positions; RMSNorm keeps activations in range.",
    "12 + 34 = 46. 7 * 8 = 56. Paged KV caches let many requests share memory.",
] * 8


@attrs.frozen(kw_only=True)
class DemoConfig:
    """Build, save, reload and run a tiny random model."""

    out: Path = Path("runs/demo")
    """Where the demo model folder is written."""
    seed: int = 0
    """Seed of the random weights."""


def main(cfg: DemoConfig) -> None:
    """Run the demo."""
    console.rule("[bold]astrai demo (random weights; training arrives with the quickstart)")
    tokenizer = train_tokenizer(CORPUS, vocab_size=400, chat_template=chatml_template())
    config = attrs.evolve(tiny(tokenizer.vocab_size), eos_token_id=(tokenizer.eos_token_id,))
    model = Model(
        config=config,
        params=init_params(config, seed=cfg.seed),
        tokenizer=tokenizer,
        eos_token_ids=(tokenizer.eos_token_id,),
    )
    path = save(model, cfg.out)
    console.print(f"saved a random {model.num_parameters:,}-parameter model to [bold]{path}[/]")
    reloaded = load(path)
    ids = torch.tensor([tokenizer.encode("astrai is a hackable LLM stack")])
    same = torch.equal(forward(model.params, config, ids), forward(reloaded.params, reloaded.config, ids))
    console.print(f"reloaded logits identical to the originals: [bold]{same}[/]")
    info.main(info.InfoConfig(model=path))
    console.print("[bold]astrai generate[/] (greedy, 24 tokens):")
    generate.main(generate.GenerateConfig(model=path, prompt="The quick brown fox", max_tokens=24))
    shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
    console.print(f"\nnext: [bold].venv/bin/astrai chat --model {shown}[/]  (or `astrai ...` in an activated venv)")


if __name__ == "__main__":
    main(tyro.cli(DemoConfig))
