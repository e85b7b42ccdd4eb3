"""The optimizer's parameter groups: weight decay on the weight matrices only.

transformers' Trainer rule (``Trainer.get_decay_parameter_names``: no decay on biases and on
the weights of LayerNorm/RMSNorm layers, found by layer type and by name), plus no decay on
embeddings (``nn.Embedding`` weights, and so on an output head tied to them): decaying a
token's embedding pulls rare tokens to zero between their updates.  Only parameters that
train are grouped, so a model with frozen parts (adapters) gets groups of its trainable
parameters alone.
"""

from __future__ import annotations

import torch
from transformers import Trainer


def no_decay_names(model: torch.nn.Module) -> set[str]:
    """Names (as ``named_parameters`` gives them) of the parameters that get no weight decay."""
    # get_decay_parameter_names reads nothing of the Trainer: called unbound, it is the library's rule as it stands.
    decay = set(Trainer.get_decay_parameter_names(None, model))
    embeddings = {f"{module_name}.{name}" if module_name else name
                  for module_name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)
                  for name, _ in module.named_parameters(recurse=False)}
    return {name for name, _ in model.named_parameters() if name not in decay or name in embeddings}


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """``[{"params": decayed, "weight_decay": weight_decay}, {"params": the rest, "weight_decay": 0.0}]`` over the
    trainable parameters (a group without parameters is left out), for ``deepspeed.initialize(model_parameters=...)``."""
    exempt = no_decay_names(model)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in trainable if name not in exempt], "weight_decay": weight_decay},
              {"params": [p for name, p in trainable if name in exempt], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]
