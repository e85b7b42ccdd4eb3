"""Weights -> a Hugging Face model folder (sharded safetensors + index, config, tokenizer), one shard at a time.

``save_pretrained`` needs the whole state dict in memory; the weights of a model trained
at scale do not fit in one host's memory (70B in fp32: 280 GB).  The writer here takes a
:class:`WeightsSource` instead: every tensor's name, shape and dtype up front (meta
tensors, no data) and a function that materializes a group of them.  It plans the shards
with huggingface_hub's ``split_torch_state_dict_into_shards`` (the planner
``save_pretrained`` uses) and materializes, casts, writes (safetensors) and drops one
shard at a time, so it never holds more than one shard plus what the source needs to
make one tensor.  The rest is done as ``save_pretrained`` does it, on the model built on
the meta device from the config: tied weights are written once, transformers' weight
renamings are reverted shard by shard (its own way for offloaded models), and the config
(with dtype and architecture) and generation config are saved.  The folder is filled
beside its destination, synced, and renamed into place.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.serialization._base import parse_size_to_int  # the planner's own parser ("5GB" -> bytes)
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion
from transformers.dynamic_module_utils import custom_object_save
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from ..errors import InputError
from ..files import atomic_folder

WEIGHTS_PATTERN = "model{suffix}.safetensors"  # transformers' names: model.safetensors, model-00001-of-00003...
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # save_pretrained's default


@dataclass
class WeightsSource:
    """A model's weights without holding them: what there is, and a way to make a group of tensors real.

    ``specs`` maps every name of the model's ``state_dict()`` (tied aliases included) to a
    meta tensor of its shape and dtype; ``load(names)`` yields (name, tensor) for those names,
    on the CPU, one at a time, so that the writer casts each before the next one exists.
    """

    specs: dict[str, torch.Tensor]
    load: Callable[[list[str]], Iterator[tuple[str, torch.Tensor]]]


def in_memory_weights(state_dict: Mapping[str, torch.Tensor]) -> WeightsSource:
    """A state dict that is in memory already (a small model, adapters) as a source."""
    return WeightsSource({name: tensor.to("meta") for name, tensor in state_dict.items()},
                         lambda names: ((name, state_dict[name]) for name in names))


def shard_size_bytes(max_shard_size: str, flag: str = "--max-shard-size") -> int:
    """``max_shard_size`` ("5GB", "500MB", "200KB") in bytes, or InputError naming ``flag``."""
    try:
        size = parse_size_to_int(max_shard_size)
    except ValueError as error:
        raise InputError(f"{flag} {max_shard_size}: not a size such as 5GB, 500MB or 200KB ({error})") from None
    if size < 1:
        raise InputError(f"{flag} {max_shard_size}: must be more than 0 bytes")
    return size


def _output_dtype(spec: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if spec.is_floating_point() else spec.dtype  # integer and boolean buffers keep theirs


def write_hf_folder(out: str | Path, weights: WeightsSource, config, tokenizer, dtype: torch.dtype,
                    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE, trust_remote_code: bool = False,
                    where: str = "the weights") -> dict:
    """Writes ``weights`` cast to ``dtype`` as a Hugging Face folder ``out`` (replaced if it exists: the caller
    decides whether it may be); returns {"files": the weight files, "parameters": the model's parameter count}.
    ``where`` names the weights' origin in errors."""
    shard_bytes = shard_size_bytes(max_shard_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    expected = model.state_dict()
    missing, unexpected = expected.keys() - weights.specs.keys(), weights.specs.keys() - expected.keys()
    if missing or unexpected:
        raise InputError(f"{where}: do not fit the model of the config ({type(model).__name__}): missing "
                         f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    for name, spec in weights.specs.items():
        if spec.shape != expected[name].shape:
            raise InputError(f"{where}: {name} has the shape {tuple(spec.shape)}, the model of the config "
                             f"{tuple(expected[name].shape)}")
    written = remove_tied_weights_from_state_dict(dict(expected), model)  # the names save_pretrained writes, in order
    plan = split_torch_state_dict_into_shards(
        {name: torch.empty(weights.specs[name].shape, dtype=_output_dtype(weights.specs[name], dtype), device="meta")
         for name in written}, filename_pattern=WEIGHTS_PATTERN, max_shard_size=shard_bytes)
    model.config.dtype = str(dtype).removeprefix("torch.")  # as save_pretrained records it
    model.config.architectures = [type(model).__name__]

    def fill(folder: Path) -> None:
        weight_map = {}
        for filename, names in plan.filename_to_tensors.items():
            shard = {}
            for name, tensor in weights.load(names):
                shard[name] = tensor.to(_output_dtype(tensor, dtype)).contiguous()
                del tensor  # the source's copy goes before the next one is made
            shard = revert_weight_conversion(model, shard)  # the checkpoint names of models that rename on load
            save_file(shard, folder / filename, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, filename))
            del shard  # freed before the next one is made
        if plan.is_sharded:
            index = {"metadata": {"total_parameters": model.num_parameters(), **plan.metadata},
                     "weight_map": dict(sorted(weight_map.items()))}
            (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if model.is_remote_code():
            custom_object_save(model, folder, config=model.config)  # the modelling code a remote-code model needs
        model.config.save_pretrained(folder)
        if model.can_generate():
            model.generation_config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    atomic_folder(out, fill)
    return {"files": sorted(plan.filename_to_tensors), "parameters": model.num_parameters()}
