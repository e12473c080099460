"""Training: losses, optimizer, schedules, the compiled train step, LoRA and the host loop."""
