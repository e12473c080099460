"""Training data: declarative preprocessing into memory-mapped shards, datasets, batches and a resumable sampler."""
