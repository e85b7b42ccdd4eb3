"""Models and tokenizers named by a Hugging Face hub id (``Qwen/Qwen2.5-0.5B-Instruct``) or by a local folder.

A name that exists on disk is a local folder and must be one (with ``config.json`` for a
model); any other name that is a valid hub id goes to ``from_pretrained`` unchanged,
which downloads into (or, with ``HF_HUB_OFFLINE=1``, only reads) the usual hub cache.
Nothing here imports torch, so the data stage and phase one can use it.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import constants, try_to_load_from_cache
from huggingface_hub.utils import HFValidationError, validate_repo_id

from .errors import InputError, first_line


def is_hub_id(name: str) -> bool:
    """True for a hub id ('org/name', 'name') that is not a path on this machine."""
    if Path(name).exists() or name.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_likely_local(name: str, where: str, file: str) -> None:
    """A hub id not in the hub cache (holding ``file``) that reads as a mistyped local path is refused at once: a bare
    name (one of the few legacy hub repositories has no organisation, a relative folder is far likelier) or an
    ``org/name`` whose ``org`` is a folder here (``runs/my-model``). The hub would answer either only after retries,
    tens of seconds later, with an error that does not name the flag."""
    if isinstance(try_to_load_from_cache(name, file), str):
        return
    if "/" not in name:
        raise InputError(f"{where} {name}: no such folder (relative to {Path.cwd()}), and not a hub id of the form "
                         f"org/name")
    parent = Path(name).parent
    if parent.is_dir():
        raise InputError(f"{where} {name}: no such folder ({parent} is a folder here, {Path(name).name} is not in "
                         f"it); a hub id whose organisation is a local folder name is not tried on the hub")


def check_model_source(name: str, where: str = "--model") -> None:
    """A local Hugging Face model folder (holding config.json) or a hub id; else one InputError naming it."""
    if is_hub_id(name):
        check_likely_local(name, where, "config.json")
        return
    folder = Path(name)
    if not (folder / "config.json").is_file():
        reason = "no config.json in the folder" if folder.is_dir() else "no such folder, and not a hub model id"
        raise InputError(f"{where} {name}: not a local HF model folder ({reason})")


def hub_load_error(where: str, name: str, error: BaseException) -> InputError:
    """The one-line error for a hub id ``from_pretrained`` could not load (offline mode named when it is on)."""
    offline = (" (HF_HUB_OFFLINE is set: only the local hub cache is read; run once online or download it with "
               "`hf download`)" if constants.HF_HUB_OFFLINE else "")
    return InputError(f"{where} {name}: cannot load it from the Hugging Face hub{offline} ({first_line(error)})")


def hub_commit(name: str, revision: str | None, where: str = "--model") -> str:
    """The commit of ``revision`` (default: main) of hub model ``name``, from the local cache (config.json, which
    phase one has fetched): what a precomputed reference is fingerprinted with instead of the weight files."""
    cached = try_to_load_from_cache(name, "config.json", revision=revision)
    if not isinstance(cached, str):
        raise InputError(f"{where} {name}: config.json of revision {revision or 'main'} is not in the hub cache")
    return Path(cached).parent.name
