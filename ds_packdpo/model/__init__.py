"""Model-side code: building models, collating rows, attention, log-probs, losses, FLOPs (torch, no process group)."""
