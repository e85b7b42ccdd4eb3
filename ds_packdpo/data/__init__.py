"""Data and planning: loading, validation, tokenization and the step plan (no torch, no process group)."""
