"""Checkpoint -> Hugging Face folder (safetensors + config + tokenizer), with no process group.

The ZeRO shards are gathered offline by DeepSpeed's own ``zero_to_fp32`` (the fp32
master weights, exact whatever the training dtype; a LoRA run's frozen base weights
too, as DeepSpeed saves them beside the adapters), loaded into a model built from
the config saved in the checkpoint (with the LoRA adapters its adapter config
describes), cast to the requested dtype and written with ``save_pretrained``
(safetensors): a LoRA model merged into plain weights, or its adapters alone as a
peft folder (``adapter_config.json``, ``adapter_model.safetensors``).  The folder is written next to its destination
and renamed into place, so it is never half written, and an existing non-empty
folder is only replaced with ``overwrite``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import zipfile
from pathlib import Path

import torch
from deepspeed.utils.zero_to_fp32 import (get_fp32_state_dict_from_zero_checkpoint, get_model_state_files,
                                          get_optim_files)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..config import DTYPES
from ..errors import InputError, first_line
from ..model.build import TORCH_DTYPES
from ..model.lora import ADAPTER_CONFIG_FILE, adapters_from_folder, hf_model
from .checkpoint import HF_FOLDER, resolve_checkpoint


def check_export_target(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InputError(f"--out {out}: folder is not empty (pass --overwrite to replace it)")


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


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str | None = None, overwrite: bool = False,
                      trust_remote_code: bool = False, adapter_only: bool = False) -> dict:
    """Writes the model of ``checkpoint`` (a tag folder or a save folder with ``latest``) to ``out``.

    A LoRA checkpoint (its ``hf/adapter_config.json``) is written with its adapters merged into the base
    weights (a plain Hugging Face folder), or with ``adapter_only`` as a peft adapter folder.
    """
    out = Path(out)
    check_export_target(out, overwrite)
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
    # DeepSpeed reads its shards with torch.load(weights_only=False): export only checkpoints you trust.
    try:
        state_dict = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as error:  # torch.load of a damaged file
        shard = unreadable_shard(tag_dir)
        if shard is None:
            raise
        raise InputError(f"--checkpoint {tag_dir}: {shard.name} is unreadable (corrupt or truncated: "
                         f"{first_line(error)})") from None
    torch_dtype = TORCH_DTYPES[dtype]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
        if lora:
            model = adapters_from_folder(model, hf_dir)
    model.load_state_dict(state_dict, strict=True, assign=True)
    hf_model(model).tie_weights()
    if lora and not adapter_only:
        model = model.merge_and_unload()  # in fp32, then cast: W + alpha / r x B A
    model.to(torch_dtype)
    hf_model(model).config.dtype = torch_dtype

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)  # a peft model writes its adapter files only
        tokenizer.save_pretrained(folder)

    write_folder(out, write)
    return {"checkpoint": str(tag_dir), "out": str(out), "dtype": dtype,
            "parameters": sum(t.numel() for t in state_dict.values()),
            "global_step": state["position"]["global_step"],
            "written": "adapter" if adapter_only else "merged" if lora else "model"}


def write_folder(out: Path, write) -> None:
    """``write(folder)`` into a staging folder beside ``out``, then renamed into place: never half written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        staging.mkdir()
        write(staging)
        if out.exists():
            shutil.rmtree(out)  # empty, or --overwrite
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
