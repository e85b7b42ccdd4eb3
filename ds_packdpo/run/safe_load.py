"""Loading a checkpoint runs no code: every ``.pt`` is unpickled with ``weights_only=True``.

DeepSpeed reads its own files with ``torch.load(weights_only=False)`` (its engine's
loader, ``ds_to_universal``, the universal loader, ``zero_to_fp32``), so a checkpoint
from someone else could run code on every rank.  torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``
turns every ``torch.load`` into a weights-only one, whatever its caller passed; the few
DeepSpeed types its ZeRO files pickle are registered as safe (``add_safe_globals``).
Phase one also scans every pickle of a checkpoint for the globals it names
(``get_unsafe_globals_in_checkpoint``: a static disassembly, nothing executed), so a
malicious file is refused in one line before any rank starts.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from ..errors import first_line

FORCE_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
# What deepspeed 0.19.8's ZeRO optimizer files pickle besides tensors and containers (seen here: the stage, and the
# loss scaler object of fp32/bf16 runs; the dynamic one of fp16; ZeRO-1/2's parameter slice addresses, a two-int
# dataclass).
DEEPSPEED_GLOBALS = [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
torch.serialization.add_safe_globals(DEEPSPEED_GLOBALS)


@contextmanager
def weights_only_loading() -> Iterator[None]:
    """Every ``torch.load`` inside (DeepSpeed's included) unpickles with ``weights_only=True``."""
    before = os.environ.get(FORCE_ENV)
    os.environ[FORCE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[FORCE_ENV]
        else:
            os.environ[FORCE_ENV] = before


def code_in_pickle(path: Path) -> str | None:
    """Why loading ``path`` (a ``torch.save`` file) could run code, or None: the globals its pickle names beyond
    tensors, containers and the registered DeepSpeed types."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except (ValueError, RuntimeError, zipfile.BadZipFile, OSError) as error:
        return f"not a torch.save archive ({first_line(error)})"
    if unsafe:
        return f"its pickle calls {', '.join(sorted(unsafe))} (loading it would run code)"
    return None
