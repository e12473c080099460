"""`astrai info MODEL`: config, parameter counts by component, dtype and bytes, as rich tables."""

from __future__ import annotations

from collections import defaultdict

import attrs
from rich.table import Table

from astrai.cli._common import ModelArgs, ModelName, console, load_model, parse
from astrai.tree import named_tensors


@attrs.frozen(kw_only=True)
class InfoConfig:
    """Show a model's config, parameter counts, dtype and size."""

    model: ModelName
    """Model folder (HF format) or Hugging Face model id found in the local HF cache (`--model MODEL` works too)."""
    revision: str | None = None
    """Branch, tag or commit of a Hugging Face model id (unset: main)."""


def _component(name: str) -> str:
    # blocks.3.attn.q_proj.weight -> attention; embed_tokens.weight -> embedding
    if name.startswith("embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return "norms"


def parameter_table(params) -> Table:
    """Rows of parameter count and bytes per component."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for name, tensor in named_tensors(params).items():
        counts[_component(name)][0] += tensor.numel()
        counts[_component(name)][1] += tensor.numel() * tensor.element_size()
    table = Table(title="parameters")
    table.add_column("component")
    table.add_column("parameters", justify="right")
    table.add_column("MiB", justify="right")
    for comp in ("embedding", "attention", "mlp", "norms", "lm_head"):
        if comp in counts:
            n, b = counts[comp]
            table.add_row(comp, f"{n:,}", f"{b / 2**20:.2f}")
    total_n, total_b = sum(v[0] for v in counts.values()), sum(v[1] for v in counts.values())
    table.add_row("[bold]total", f"[bold]{total_n:,}", f"[bold]{total_b / 2**20:.2f}")
    return table


def main(cfg: InfoConfig) -> None:
    """Print the model's config and parameter breakdown."""
    model = load_model(ModelArgs(model=cfg.model, revision=cfg.revision, device="cpu"))  # describing needs no GPU
    table = Table(title=f"{cfg.model}")
    table.add_column("field")
    table.add_column("value")
    for field in attrs.fields(type(model.config)):
        table.add_row(field.name, str(getattr(model.config, field.name)))
    table.add_row("param dtype", str(model.dtype).removeprefix("torch."))
    table.add_row("tokenizer", repr(model.tokenizer) if model.tokenizer else "none")
    table.add_row("eos ids", str(list(model.eos_token_ids)))
    console.print(table)
    console.print(parameter_table(model.params))


if __name__ == "__main__":
    main(parse(InfoConfig, prog="astrai info"))
