"""Checkpoint -> Hugging Face folder (sharded safetensors + config + tokenizer), with no process group.

The ZeRO shards are read offline by DeepSpeed's own ``zero_to_fp32`` (the fp32 master
weights, exact whatever the training dtype) and written by the shard-at-a-time writer
(``model/hf_folder.py``), so a model larger than the host's memory can be exported.
Under ZeRO-3 DeepSpeed's lazy mode maps the optimizer shards (``torch.load(mmap=True)``)
and gathers one parameter at a time (``GatheredTensor``); the pages of a mapping that
were read stay in the process's resident memory until it is unmapped, so every shard
of the output opens the checkpoint afresh and drops it with its tensors.  The folder is
written next to its destination and renamed into place, so it is never half written,
and an existing non-empty folder is only replaced with ``overwrite``.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch
from deepspeed.utils.zero_to_fp32 import (get_fp32_state_dict_from_zero_checkpoint, get_model_state_files,
                                          get_optim_files)
from transformers import AutoConfig, AutoTokenizer

from ..config import DTYPES
from ..errors import InputError, first_line
from ..files import check_output_folder
from ..model.build import TORCH_DTYPES
from ..model.hf_folder import DEFAULT_MAX_SHARD_SIZE, WeightsSource, shard_size_bytes, write_hf_folder
from ..model.lora import ADAPTER_CONFIG_FILE, merged_weights, write_adapter_folder
from .checkpoint import HF_FOLDER, resolve_checkpoint
from .safe_load import weights_only_loading


def unreadable_shard(tag_dir: Path) -> Path | None:
    """The first shard, in the order zero_to_fp32 reads them (model states, then optimizer states), that is not
    an intact torch archive (torch.save writes a zip: truncation or damage fails its directory or CRC check)."""
    for path in [*get_model_state_files(str(tag_dir)), *get_optim_files(str(tag_dir))]:
        try:
            with zipfile.ZipFile(path) as archive:
                if archive.testzip() is None:
                    continue
        except (zipfile.BadZipFile, OSError):
            pass
        return Path(path)
    return None


def _lazy_fp32_state_dict(tag_dir: Path) -> dict:
    """DeepSpeed's lazy fp32 state dict of ``tag_dir`` (its progress lines silenced: one read per output shard)."""
    # DeepSpeed reads its shards with torch.load(weights_only=False): forced to True here (run/safe_load.py)
    with open(os.devnull, "w") as quiet, redirect_stdout(quiet), redirect_stderr(quiet), weights_only_loading():
        return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name, lazy_mode=True)


def zero_checkpoint_weights(tag_dir: Path, zero_stage: int) -> WeightsSource:
    """The fp32 master weights of a ZeRO checkpoint as a source for the writer."""
    try:
        lazy = _lazy_fp32_state_dict(tag_dir)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as error:  # torch.load of a damaged file
        shard = unreadable_shard(tag_dir)
        if shard is None:
            raise
        raise InputError(f"--checkpoint {tag_dir}: {shard.name} is unreadable (corrupt or truncated: "
                         f"{first_line(error)})") from None
    specs = {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta") for name, tensor in lazy.items()}
    # ZeRO 1-2: DeepSpeed merges every flat group whole even in lazy mode; keep that one copy instead of remaking it
    kept = lazy if zero_stage < 3 else None
    del lazy

    def load(names):
        state = kept if kept is not None else _lazy_fp32_state_dict(tag_dir)
        for name in names:
            yield name, state[name].contiguous()  # one parameter gathered from every rank's shard

    return WeightsSource(specs, load)


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str | None = None, overwrite: bool = False,
                      trust_remote_code: bool = False, max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
                      adapter_only: bool = False) -> dict:
    """Writes the model of ``checkpoint`` (a tag folder or a save folder with ``latest``) to ``out``.

    A LoRA checkpoint is written with its adapters merged into the base weights (a plain
    Hugging Face folder), or with ``adapter_only`` as a peft adapter folder.
    """
    out = Path(out)
    check_output_folder(out, "--out", overwrite, reads=[checkpoint])
    shard_size_bytes(max_shard_size)
    tag_dir, state = resolve_checkpoint(checkpoint, "--checkpoint")
    dtype = dtype or state["dtype"]
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype}: not one of {', '.join(DTYPES)}")
    if state["zero_stage"] == 0:
        raise InputError(f"--checkpoint {tag_dir}: written without ZeRO; export reads ZeRO 1-3 checkpoints")
    hf_dir = tag_dir / HF_FOLDER
    lora = (hf_dir / ADAPTER_CONFIG_FILE).is_file()
    if adapter_only and not lora:
        raise InputError(f"--adapter-only: {tag_dir} was trained without LoRA (no {HF_FOLDER}/{ADAPTER_CONFIG_FILE}); "
                         f"export it without --adapter-only")
    config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=trust_remote_code, local_files_only=True)
    weights = zero_checkpoint_weights(tag_dir, state["zero_stage"])
    if adapter_only:
        written = write_adapter_folder(out, weights, hf_dir, config, tokenizer, TORCH_DTYPES[dtype], trust_remote_code)
    else:
        if lora:
            weights = merged_weights(weights, hf_dir, config, trust_remote_code)
        written = write_hf_folder(out, weights, config, tokenizer, TORCH_DTYPES[dtype], max_shard_size,
                                  trust_remote_code, where=f"--checkpoint {tag_dir}")
    return {"checkpoint": str(tag_dir), "out": str(out), "dtype": dtype, **written,
            "global_step": state["position"]["global_step"],
            "written": "adapter" if adapter_only else "merged" if lora else "model"}
