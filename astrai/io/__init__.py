"""Checkpoint and tokenizer I/O: HF folders <-> (ModelConfig, params tree, Tokenizer)."""
