"""Training: loss, schedule, checkpoints, the loop."""
