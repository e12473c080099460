"""Inference: KV pages, compiled prefill/decode steps, sampling and generation loops."""
