"""The run: assembly, parallel layout, DeepSpeed engines, sequence parallelism, the loop, metrics, checkpoints."""
