"""The model's layers made faster without changing what they compute: --compile-layers and --liger-kernels.

**Regional compilation** (``--compile-layers``): each decoder layer's ``forward`` through ``torch.compile``.  Only
the layer's forward, not its ``__call__``: ZeRO-3's gather and release hooks and transformers' activation
checkpointing stay outside the compiled code, where they run as without it.  Every layer runs the same code
object, so the layers share one compiled graph (torch's regional compilation) and compile time is a layer's, not the
model's.  Packed rows change length at every step: the token dimension is dynamic from the start (``dynamic=True``),
so a new row length reuses the graph instead of recompiling.  The attention call stays eager
(``torch.compiler.disable``): the varlen kernels take a row's boundaries and longest sequence as Python numbers (each
new value would be a new graph) and ``sdpa_varlen`` loops over the row's sequences; it is one fused kernel already,
and the compiled regions are what surrounds it (norms, rotary, SwiGLU, residuals, the projections' epilogues).

**Liger kernels** (``--liger-kernels``): the liger-kernel package's fused Triton RMSNorm, SwiGLU and rotary kernels
patched into the model (its ``_apply_liger_kernel_to_instance``; its cross-entropy kernels stay off: the log-prob
stage is this package's own).  Triton runs on CUDA only: elsewhere the model keeps torch's layers, said once in phase
one (:func:`liger_obstacle`).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from transformers import AttentionInterface

COMPILE_BACKEND = "inductor"
LIGER_PATCHES = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules of the classes transformers names as not to be split."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (_no_split_modules: {sorted(names)})")
    return layers


def _eager_attention(implementation: str) -> None:
    """The attention function of ``implementation`` left out of compiled graphs (idempotent)."""
    function = AttentionInterface._global_mapping.get(implementation)
    if function is not None and not getattr(function, "_ds_packdpo_eager", False):
        eager = torch.compiler.disable(function)
        eager._ds_packdpo_eager = True
        AttentionInterface.register(implementation, eager)


def compile_decoder_layers(model: torch.nn.Module, backend=COMPILE_BACKEND) -> int:
    """Compiles every decoder layer's forward in place; returns how many layers."""
    _eager_attention(model.config._attn_implementation)
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, backend=backend)
    return len(layers)


def keep_hooks_eager(model: torch.nn.Module) -> None:
    """The forward hooks of the compiled layers' submodules (ZeRO-3's gather and release, registered when the engine
    starts) left out of the graphs: traced, DeepSpeed's hook wrappers recompile with every new module type (up to
    torch's limit) and split the layer's graph anyway.  Called once the engine holds the model (idempotent)."""
    for layer in decoder_layers(model):
        for module in layer.modules():
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                for key, hook in list(hooks.items()):
                    if not getattr(hook, "_ds_packdpo_eager", False):
                        hooks[key] = torch.compiler.disable(hook)
                        hooks[key]._ds_packdpo_eager = True


def liger_obstacle(device_type: str) -> str | None:
    """Why --liger-kernels cannot run here: the reason the model keeps torch's layers (None: they run)."""
    if device_type != "cuda":
        return f"liger-kernel's Triton kernels run on CUDA only; this run's device is {device_type}"
    if importlib.util.find_spec("liger_kernel") is None:
        return "the liger-kernel package is not installed (pip install -e '.[liger]')"
    return None


def apply_liger_kernels(model: torch.nn.Module) -> None:
    """Patches liger-kernel's norm, SwiGLU and rotary kernels into ``model`` (its architecture's own function)."""
    liger = importlib.import_module("liger_kernel.transformers")  # an optional package: runs with the flag only
    liger._apply_liger_kernel_to_instance(model=model, **LIGER_PATCHES)
