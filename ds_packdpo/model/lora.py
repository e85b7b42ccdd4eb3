"""LoRA adapters on the policy (peft): their settings, the check before any weights exist, and the wrapping.

``--lora-r R`` freezes every base weight and trains low-rank adapters ``B A`` (scaled
by ``alpha / r``) on the target modules.  The base model is built as always (under
ZeRO-3 its weights are partitioned at construction by ``zero.Init``); the adapters
are added afterwards as ordinary parameters, and DeepSpeed's engine converts every
parameter that is not yet a ZeRO parameter when it starts (broadcast from rank 0,
then partitioned: ``DeepSpeedZeRoOffload._convert_to_zero_parameters``), so adapters
are sharded like the base and identical on every rank.  Only the adapters require
gradients, so only they reach the optimizer.

The reference of a LoRA run is the policy itself with its adapters switched off
(:func:`as_reference`, peft's ``disable_adapter``): the same weights, the same
packed row and backend, no second model.

peft is an optional extra (``pip install -e '.[lora]'``): without it ``--lora-r`` is
refused in phase one, and nothing else needs it.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from ..errors import InputError, first_line
from ..files import atomic_folder
from .hf_folder import WeightsSource

try:
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import Linear as LoraLinear
    from peft.utils import SAFETENSORS_WEIGHTS_NAME as ADAPTER_WEIGHTS_FILE
except ImportError:  # the optional extra is not installed: --lora-r is refused in phase one
    LoraConfig = PeftModel = get_peft_model = get_peft_model_state_dict = LoraLayer = LoraLinear = None
    ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"

ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output layer (the lm_head)
ADAPTER = "default"  # peft's name of the one adapter a run trains
ADAPTER_CONFIG_FILE = "adapter_config.json"  # peft's CONFIG_NAME: what a checkpoint of a LoRA run carries in hf/


@dataclass(frozen=True)
class LoraSettings:
    """--lora-r, --lora-alpha, --lora-dropout and --lora-target-modules of a run (r > 0)."""

    r: int
    alpha: float  # --lora-alpha, default 2 x r
    dropout: float
    target_modules: str  # ALL_LINEAR, or comma-separated module names

    def __post_init__(self):
        if not [name for name in self.target_modules.split(",") if name.strip()]:
            raise InputError("--lora-target-modules: no module name given")

    @property
    def target_names(self) -> list[str] | str:
        """peft's ``target_modules``: the special 'all-linear', or a list of names (a name matches a module whose
        qualified name is it or ends with '.' + it)."""
        if self.target_modules == ALL_LINEAR:
            return ALL_LINEAR
        return [name.strip() for name in self.target_modules.split(",") if name.strip()]

    @property
    def adapts_head(self) -> bool:
        """Whether an adapter lands on the lm_head ('all-linear' leaves it out; a name matches by suffix)."""
        return self.target_names != ALL_LINEAR and any(name.split(".")[-1] == "lm_head" for name in self.target_names)

    def peft_config(self):
        require_peft()
        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=self.target_names,
                          bias="none", task_type="CAUSAL_LM")

    def as_dict(self) -> dict:
        """What a checkpoint records of them (a resume must match it)."""
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout, "target_modules": self.target_modules}


def require_peft() -> None:
    if LoraConfig is None:
        raise InputError("--lora-r needs peft, which is not installed (pip install -e '.[lora]')")


def _module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the modules LoRA can wrap (linear and embedding layers), for error messages."""
    kinds = (torch.nn.Linear, torch.nn.Embedding)
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if name and isinstance(module, kinds)})


def check_adapters(settings: LoraSettings, hf_config, where: str, trust_remote_code: bool = False) -> None:
    """Phase one: the adapters placed on the model's skeleton (meta device, no memory).

    A target name that matches no module is refused naming the modules that exist
    (peft refuses only when no name matches at all), and whatever peft refuses (a
    module type LoRA cannot wrap) becomes one line naming the flag.
    """
    require_peft()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    names = [name for name, _ in model.named_modules()]
    if settings.target_names != ALL_LINEAR:
        for target in settings.target_names:
            if not any(name == target or name.endswith("." + target) for name in names):
                raise InputError(f"--lora-target-modules {settings.target_modules}: '{target}' matches no module of "
                                 f"{where} (its linear and embedding modules: {', '.join(_module_names(model))}; "
                                 f"or '{ALL_LINEAR}')")
    try:
        add_adapters(model, settings)
    except (ValueError, TypeError) as error:  # peft's refusals (NoMatchingPeftModuleError is a ValueError)
        raise InputError(f"--lora-target-modules {settings.target_modules}: LoRA cannot wrap it in {where} "
                         f"({first_line(error)})") from None


def add_adapters(model: torch.nn.Module, settings: LoraSettings, seed: int = 0, base: str | None = None):
    """``model`` with LoRA adapters (a peft model), every base weight frozen; ``base`` names the base model (a
    folder) in the adapter config, which checkpoints carry and an exported adapter folder points to.

    The adapters' random initialization (A; B starts at zero) is drawn from ``seed``
    alone, so it is the same whatever the world size or the ranks did before.  They
    take the base weights' dtype (peft would otherwise upcast bf16 adapters to fp32,
    a dtype the engine does not train in).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, settings.peft_config(), adapter_name=ADAPTER, autocast_adapter_dtype=False)
    wrapped.peft_config[ADAPTER].base_model_name_or_path = base
    return wrapped


def save_adapter_config(policy, folder) -> None:
    """The adapter config of a LoRA policy (a DeepSpeed engine or a peft model) into ``folder``."""
    getattr(policy, "module", policy).peft_config[ADAPTER].save_pretrained(str(folder))


def adapters_from_folder(model: torch.nn.Module, folder):
    """``model`` with the (freshly initialized) adapters that ``folder``'s adapter config describes."""
    require_peft()
    config = LoraConfig.from_pretrained(str(folder))
    base, config.base_model_name_or_path = config.base_model_name_or_path, None  # get_peft_model resets it
    wrapped = get_peft_model(model, config, adapter_name=ADAPTER, autocast_adapter_dtype=False)
    wrapped.peft_config[ADAPTER].base_model_name_or_path = base
    return wrapped


# ----------------------------------------------------------------------------- export
PEFT_PREFIX = "base_model.model."  # where a peft model keeps the wrapped model's weights in its state dict


def _peft_skeleton(config, adapter_folder, trust_remote_code: bool):
    """The peft model of ``config`` with the adapters of ``adapter_folder``, on the meta device (no memory)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
        return adapters_from_folder(model, adapter_folder)


def _merged_name(name: str) -> str:
    """A LoRA checkpoint's name of a base weight -> the plain model's name (``...q_proj.base_layer.weight`` ->
    ``...q_proj.weight``)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def merged_weights(weights: WeightsSource, adapter_folder, config, trust_remote_code: bool = False) -> WeightsSource:
    """The weights of a LoRA checkpoint with every adapter merged into its base weight, made one tensor at a time.

    The adapters (small) are loaded at once into the meta-device peft model, so peft's
    own ``get_delta_weight`` gives each layer's ``scaling x B A`` (transposes, embedding
    adapters, rank-stabilized scaling included); a base weight is streamed from
    ``weights`` and gets its delta added as the writer asks for it, so the merge holds no
    more than the writer's shard (``merge_and_unload`` would need the whole model).
    """
    model = _peft_skeleton(config, adapter_folder, trust_remote_code)
    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    adapter_names = {f"{layer}.{param}" for layer, module in layers.items()
                     for param, _ in module.named_parameters() if not param.startswith("base_layer.")}
    model.load_state_dict(dict(weights.load(sorted(adapter_names))), strict=False, assign=True)
    sources = {_merged_name(name): name for name in weights.specs if name not in adapter_names}

    def delta(source: str) -> torch.Tensor | None:
        layer = layers.get(source.removesuffix(".base_layer.weight")) if source.endswith(".base_layer.weight") else None
        return None if layer is None else layer.get_delta_weight(ADAPTER)

    def load(names):
        with torch.no_grad():
            for source, tensor in weights.load([sources[name] for name in names]):
                change = delta(source)
                yield _merged_name(source), tensor if change is None else tensor + change.to(tensor.dtype)

    return WeightsSource({name: weights.specs[source] for name, source in sources.items()}, load)


def write_adapter_folder(out, weights: WeightsSource, adapter_folder, config, tokenizer, dtype: torch.dtype,
                         trust_remote_code: bool = False) -> dict:
    """A LoRA checkpoint's adapters as a peft folder (``adapter_config.json``, ``adapter_model.safetensors``, the
    tokenizer), as ``PeftModel.save_pretrained`` writes it, written whole or not at all.

    peft itself picks the tensors (``get_peft_model_state_dict``: the adapters, and the
    embedding layers when it would save them) from a state dict of meta stand-ins, so
    only what it picks is ever loaded.
    """
    model = _peft_skeleton(config, adapter_folder, trust_remote_code)
    picked = get_peft_model_state_dict(model, state_dict=dict(weights.specs), adapter_name=ADAPTER)
    source_of = {id(spec): name for name, spec in weights.specs.items()}
    names = {key: source_of[id(spec)] for key, spec in picked.items()}
    loaded = dict(weights.load(list(names.values())))
    tensors = {key: loaded[name].to(dtype).contiguous() for key, name in names.items()}
    adapter_config = copy.deepcopy(model.peft_config[ADAPTER])
    adapter_config.inference_mode = True  # as PeftModel.save_pretrained writes it

    def fill(folder: Path) -> None:
        save_file(tensors, folder / ADAPTER_WEIGHTS_FILE, metadata={"format": "pt"})
        adapter_config.save_pretrained(str(folder))
        tokenizer.save_pretrained(folder)

    atomic_folder(out, fill)
    return {"files": [ADAPTER_WEIGHTS_FILE], "parameters": sum(t.numel() for t in tensors.values())}


def is_peft_model(model) -> bool:
    return PeftModel is not None and isinstance(model, PeftModel)


def hf_model(model) -> torch.nn.Module:
    """The Hugging Face model itself: behind a DeepSpeed engine (``.module``) and behind peft's wrappers."""
    inner = getattr(model, "module", None)
    model = inner if isinstance(inner, torch.nn.Module) else model
    return model.get_base_model() if is_peft_model(model) else model


@contextlib.contextmanager
def as_reference(policy):
    """Inside the block the policy (a DeepSpeed engine or a peft model) is its own reference: adapters switched
    off, in eval mode (no dropout), as a separate frozen reference runs."""
    inner = getattr(policy, "module", policy)
    was_training = inner.training
    inner.eval()
    try:
        with inner.disable_adapter():
            yield
    finally:
        inner.train(was_training)


@dataclass
class LowRankHead:
    """The parts of an lm_head that carries a LoRA adapter: logits = base(x) + scaling * up(down(dropout(x)))."""

    base: torch.nn.Linear
    down: torch.nn.Linear
    up: torch.nn.Linear
    dropout: torch.nn.Module
    scaling: float


def split_head(head: torch.nn.Module) -> tuple[torch.nn.Module, LowRankHead | None]:
    """(the linear layer holding the head's V x H weight, its active LoRA adapter or None).

    A head with its adapters switched off (the reference forward) or merged computes
    its base layer alone.
    """
    if LoraLinear is None or not isinstance(head, LoraLinear):
        return head, None
    if head.disable_adapters or head.merged or ADAPTER not in head.lora_A or ADAPTER not in head.active_adapters:
        return head.get_base_layer(), None
    return head.get_base_layer(), LowRankHead(head.get_base_layer(), head.lora_A[ADAPTER], head.lora_B[ADAPTER],
                                              head.lora_dropout[ADAPTER], float(head.scaling[ADAPTER]))


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, all) parameters, counting ZeRO-3-partitioned ones in full (``ds_numel``)."""
    trainable = total = 0
    for parameter in model.parameters():
        count = int(getattr(parameter, "ds_numel", parameter.numel()))
        total += count
        trainable += count if parameter.requires_grad else 0
    return trainable, total
