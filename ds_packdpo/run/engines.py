"""DeepSpeed engines: the trainable policy and the frozen reference.

ds_packdpo plans every optimizer step itself (a variable number of packed rows
per rank), so the DeepSpeed batch settings are pinned to one row per forward
and one "accumulation step": the trainer marks the accumulation boundary and
scales the loss explicitly.  The batch keys a user's config writes count pairs
and became the run's settings in phase one (run/user_values.py).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig
from pydantic import ValidationError
from transformers.integrations import HfDeepSpeedConfig

from ..config import read_mapping
from ..errors import InputError, first_line
from ..model.config_rules import check_forward_rules, check_model_folder
from ..model.build import TORCH_DTYPES, ModelSpec, build_model, load_model_config, load_pretrained_config
from ..model.kernels import apply_liger_kernels, compile_decoder_layers, keep_hooks_eager
from ..model.lora import add_adapters
from ..model.param_groups import weight_decay_groups
from .layout import ParallelLayout
from .metrics import OutputSpec
from .schedule import Schedule, start_schedule
from .user_values import monitor_sections, optimizer_section


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer DeepSpeed builds (the flags', or the DeepSpeed config's own values taken as them in phase one,
    run/user_values.py), and the gradient clipping."""

    name: str  # a DeepSpeed optimizer or a torch.optim class
    lr: float  # the peak LR (the schedule's)
    betas: tuple[float, float]  # Adam/AdamW
    eps: float  # Adam/AdamW
    weight_decay: float  # of every parameter but biases, norm weights and embeddings
    max_grad_norm: float  # 0: no clipping

@dataclass(frozen=True)
class ZeroSpec:
    """ZeRO's communication (the --zero-* flags, or the DeepSpeed config's zero_optimization values taken as them in
    phase one): None leaves a bucket to the hidden-size rule of :func:`fill_ds_config`, overlap_comm to the config
    ("auto": on) or to DeepSpeed."""

    prefetch_bucket_size: int | None  # stage3_prefetch_bucket_size
    param_persistence_threshold: int | None  # stage3_param_persistence_threshold
    reduce_bucket_size: int | None
    overlap_comm: bool | None

    def keys(self, hidden_size: int) -> dict:
        """The zero_optimization values of the run, at a model of ``hidden_size`` (HF's rules for "auto")."""
        def given_or(value, default):
            return default if value is None else value

        return {"reduce_bucket_size": given_or(self.reduce_bucket_size, hidden_size * hidden_size),
                "stage3_prefetch_bucket_size": given_or(self.prefetch_bucket_size, int(0.9 * hidden_size * hidden_size)),
                "stage3_param_persistence_threshold": given_or(self.param_persistence_threshold, 10 * hidden_size),
                "overlap_comm": given_or(self.overlap_comm, True)}

    def written(self) -> dict:
        """The keys the settings give (a config that leaves them out gets them too)."""
        return {key: value for key, value in (("reduce_bucket_size", self.reduce_bucket_size),
                                              ("stage3_prefetch_bucket_size", self.prefetch_bucket_size),
                                              ("stage3_param_persistence_threshold", self.param_persistence_threshold),
                                              ("overlap_comm", self.overlap_comm)) if value is not None}


# DeepSpeed's monitor sections: the trainer reports through the policy engine's monitor only.
_MONITOR_KEYS = ("tensorboard", "wandb", "csv_monitor", "comet")
# The config section each of DeepSpeed's pydantic models reads, to name the key in an error.
_SECTION_OF_MODEL = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedBF16Config": "bf16",
                     "DeepSpeedFP16Config": "fp16"}


# The built-in DeepSpeed configs ship inside the package (the checkout's top-level ds_configs/ links here), so an
# installed package finds them as well as a source checkout.
BUILTIN_DS_CONFIGS = resources.files("ds_packdpo") / "ds_configs"


def builtin_ds_configs() -> list[str]:
    return sorted(entry.name.removesuffix(".json") for entry in BUILTIN_DS_CONFIGS.iterdir()
                  if entry.name.endswith(".json"))


def load_ds_config(name_or_path: str) -> tuple[dict, str]:
    """Reads a DeepSpeed config by built-in name (zero3, ...) or path (JSON, or YAML by its suffix); returns (config,
    path)."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = BUILTIN_DS_CONFIGS / f"{name_or_path}.json"
    if not path.is_file():
        raise InputError(f"--ds-config {name_or_path}: no such file (built-in names: {', '.join(builtin_ds_configs())})")
    return read_mapping(str(path), "--ds-config"), str(path)


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def _replace_auto(node, values: dict, path: str, source: str):
    """Replaces "auto" leaves by the value named after their key; any "auto" left over is an error."""
    if isinstance(node, dict):
        return {k: _replace_auto(v, values, f"{path}.{k}" if path else k, source) for k, v in node.items()}
    if node == "auto":
        key = path.rsplit(".", 1)[-1]
        if path in values:
            return values[path]
        if key in values:
            return values[key]
        raise InputError(f"--ds-config {source}: no value for \"auto\" at '{path}'")
    return node


def _scheduler_section(given, schedule: Schedule, source: str):
    """The run's "scheduler" section (``schedule``'s); the config's own was turned into settings in phase one
    (run/user_values.py), which leaves it absent or "auto" (the built-in configs': type and params "auto")."""
    if given not in (None, "auto", {"type": "auto", "params": "auto"}):
        raise ValueError(f"--ds-config {source}: the scheduler section {given!r} was not taken into the settings")
    return schedule.deepspeed_section()


def _optimizer_section(raw: dict, name: str) -> dict:
    """The config's optimizer with what it leaves out filled from the settings (its type, lr, weight decay, and
    betas and eps for Adam/AdamW: optimizer ``name``), or the settings' optimizer when it has none."""
    optimizer = raw.get("optimizer")
    if not isinstance(optimizer, dict):
        return optimizer_section(name)
    ours = optimizer_section(name)
    params = optimizer.setdefault("params", {})
    if isinstance(params, dict):
        for key in set(params) - set(ours["params"]):
            if key in ("betas", "eps") and params[key] == "auto":
                del params[key]  # the built-in configs' Adam keys under another --optimizer
        for key, value in ours["params"].items():
            params.setdefault(key, value)
    optimizer.setdefault("type", "auto")
    return optimizer


def fill_ds_config(raw: dict, source: str, optimizer: OptimizerSpec, dtype: str, outputs: OutputSpec,
                   layout: ParallelLayout, hidden_size: int, device_type: str, schedule: Schedule,
                   zero: ZeroSpec = ZeroSpec(None, None, None, None)) -> dict:
    """The run's DeepSpeed config: "auto" values filled from the run's settings (which hold the values the config
    wrote, run/user_values.py), the batch keys pinned to one planned row per forward, the scheduler section that runs
    ``schedule``, the monitors of ``outputs``."""
    bf16 = dtype == "bf16"
    dp_world_size, sp_size = layout.dp_size, layout.sp_size
    values = {
        "train_batch_size": dp_world_size,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": optimizer.max_grad_norm,
        "bf16.enabled": bf16,
        "optimizer.type": optimizer.name,
        "lr": optimizer.lr,
        "betas": list(optimizer.betas),
        "eps": optimizer.eps,
        "weight_decay": optimizer.weight_decay,
        **zero.keys(hidden_size),
        "allgather_bucket_size": max(hidden_size * hidden_size, 1_000_000),
        "output_path": str(outputs.output_dir),  # monitors (csv, tensorboard) write under the run's folder
    }
    raw = copy.deepcopy(raw)
    scheduler = _scheduler_section(raw.pop("scheduler", None), schedule, source)
    raw["optimizer"] = _optimizer_section(raw, optimizer.name)
    ds = _replace_auto(raw, values, "", source)
    if scheduler is not None:
        ds["scheduler"] = scheduler
    for key, value in (("train_batch_size", dp_world_size), ("train_micro_batch_size_per_gpu", 1),
                       ("gradient_accumulation_steps", 1), ("gradient_clipping", optimizer.max_grad_norm)):
        ds.setdefault(key, value)  # what the config leaves out runs as the settings say
    ds.setdefault("bf16", {"enabled": bf16})
    if isinstance(ds.get("zero_optimization"), dict):  # what the config left out runs as the --zero-* flags say
        ds["zero_optimization"].update(zero.written())
    monitor_sections(outputs, ds)
    if sp_size > 1:
        if zero_stage(ds) == 3 and ds["zero_optimization"].get("reduce_scatter") is False:
            # Without reduce-scatter ZeRO-3 averages some gradient buckets over W/S ranks and others over W.
            raise InputError(f"--ds-config {source}: 'zero_optimization.reduce_scatter': false with "
                             f"--sequence-parallel-size {sp_size} (ZeRO-3 then scales gradients "
                             f"inconsistently); remove it")
        # Read by the DeepSpeedConfig that transformers' zero.Init builds without an mpu: its batch check
        # counts data-parallel ranks only (world / this), like the engines given the mpu.
        ds["sequence_parallel_size"] = sp_size
    section = ds.get("optimizer")
    if device_type == "cpu" and section and section.get("type", "").lower() in ("adam", "adamw"):
        # DeepSpeed would otherwise JIT-compile FusedAdam/CPUAdam, which needs a toolchain and minutes.
        section.setdefault("params", {}).setdefault("torch_adam", True)
    if section and section.get("type", "").lower() not in ("adam", "adamw", "lamb", "onebitadam", "lion"):
        ds.setdefault("zero_allow_untested_optimizer", True)
    validate_ds_config(ds, source)
    return ds


def validate_ds_config(ds: dict, source: str) -> None:
    """What DeepSpeed itself would refuse in every rank (its pydantic config models, its optimizer and scheduler
    names), refused here in one line naming the key, before any process group starts."""
    for section, known in (("optimizer", lambda name: name.lower() in DEEPSPEED_OPTIMIZERS
                            or hasattr(torch.optim, name)),
                           ("scheduler", lambda name: hasattr(lr_schedules, name)
                            or hasattr(torch.optim.lr_scheduler, name))):
        name = ds.get(section, {}).get("type")
        if name is not None and not (isinstance(name, str) and known(name)):
            raise InputError(f"--ds-config {source}: '{section}.type': {name!r} is neither a DeepSpeed nor a "
                             f"torch.optim {section}")
    # train_batch_size is ours (checked above); DeepSpeed derives it from the per-rank keys for the world it sees:
    # one rank before the process group, the whole world once it exists (bench and precompute-ref get here then).
    per_rank = {k: v for k, v in ds.items() if k != "train_batch_size"}
    try:
        DeepSpeedConfig(per_rank)
    except ValidationError as error:
        detail = error.errors()[0]
        section = _SECTION_OF_MODEL.get(error.title, error.title)
        key = ".".join([section, *map(str, detail["loc"])])
        raise InputError(f"--ds-config {source}: '{key}': {detail['msg']}, got {detail['input']!r}") from None
    except (ValueError, AssertionError, TypeError, KeyError) as error:
        raise InputError(f"--ds-config {source}: DeepSpeed refuses it ({first_line(error)})") from None


def reference_ds_config(policy_ds: dict, offload: bool, source: str | None = None, whole: bool = False) -> dict:
    """The frozen reference runs forward only: no optimizer, no scheduler, optional parameter offload (phase one
    builds it once with --ref-offload, so that a config without ZeRO-3 is refused before any rank starts).

    ``whole`` (--ref-whole) makes every reference parameter persistent under ZeRO-3 (DeepSpeed's own persistence
    threshold, past any parameter's size): gathered once when the engine starts and never released, so the forward
    of each row gathers nothing.  The engine stays a ZeRO-3 one so that random weights come from the same
    ``zero.Init`` as the policy's (a plain module would draw them from another device's generator on a GPU)."""
    # No monitor either: it would open a second writer (a second wandb run) that never gets an event.
    ref = {k: copy.deepcopy(v) for k, v in policy_ds.items() if k not in ("optimizer", "scheduler", *_MONITOR_KEYS)}
    zero = ref.setdefault("zero_optimization", {"stage": 0})
    zero.pop("offload_optimizer", None)
    if offload:
        if zero_stage(ref) != 3:
            raise InputError(f"--ref-offload needs a ZeRO-3 DeepSpeed config (parameter offload is a stage-3 feature); "
                             f"--ds-config {source or 'the run config'} is stage {zero_stage(ref)}")
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif zero.get("offload_param", {}).get("device") not in (None, "none"):
        zero.pop("offload_param")  # the policy offloads; the reference keeps the default unless --ref-offload
    if whole and zero_stage(ref) == 3:
        zero["stage3_param_persistence_threshold"] = zero["stage3_model_persistence_threshold"] = sys.maxsize
    return ref


def load_model(model: ModelSpec, path: str | None, vocab_size: int, attn: str, ds_config: dict | None = None):
    """The policy or reference module: ``path`` (a folder), else random weights from ``--model-config``.

    Under a ZeRO-3 ``ds_config`` the weights are partitioned at construction: while the
    ``HfDeepSpeedConfig`` lives, transformers wraps from_pretrained/from_config in
    ``deepspeed.zero.Init``, so no rank ever holds the full model.  Its layers then get the fused or compiled kernels
    of ``model`` (model/kernels.py).
    """
    keep_alive = HfDeepSpeedConfig(ds_config) if ds_config is not None and zero_stage(ds_config) == 3 else None
    torch.manual_seed(model.seed)  # policy and reference built from a config get identical weights
    module = build_model(path, model.config if path is None else None, vocab_size, TORCH_DTYPES[model.dtype], attn,
                         seed=model.seed, trust_remote_code=model.trust_remote_code,
                         revision=model.revision if path == model.path else None)
    del keep_alive
    if model.liger_kernels:
        apply_liger_kernels(module)
    if model.compile_layers:
        compile_decoder_layers(module)
    return module


def enable_gradient_checkpointing(model) -> None:
    """Activation checkpointing of every decoder layer: transformers' own, non-reentrant.

    transformers 5 checkpoints each decoder layer's ``forward`` (not its ``__call__``), so
    the hooks of the layer stay outside and those of its submodules run again in the
    recomputation: ZeRO-3 gathers each projection's partitioned weight again there, as it
    does for the backward.  Non-reentrant checkpointing recomputes inside autograd's own
    backward, so the lean log-probs' custom autograd function, the sequence-parallel
    all-reduce of the log-probs and Ulysses' all-to-alls (recomputed in the same layer
    order on every rank of the group) run as without it.  DeepSpeed's
    ``deepspeed.checkpointing`` is the reentrant Megatron kind: it needs the model's
    layers wrapped by hand and an mpu with model-parallel RNG tracking, and gives nothing
    here that transformers' does not.  A layer checkpoints only in training mode, hence
    ``train()``.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before the rename (pyproject allows >= 4.56); the same checkpointing
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()


def build_policy(model: ModelSpec, weight_decay: float, ds_config: dict, vocab_size: int, attn: str, mpu=None):
    """The trainable policy engine: every weight, or (--lora-r) LoRA adapters on the frozen base; its LR scheduler
    at the run's first iteration (a resume then loads its own).

    ``mpu`` (sequence parallelism) tells DeepSpeed the sequence-parallel groups: ZeRO then
    shards over all ranks and averages gradients over the data-parallel replicas only.
    Adapters are added after the base is built (and, under ZeRO-3, partitioned); the
    engine partitions them as it starts (model/lora.py).  Only parameters that require
    gradients go to the optimizer, in two groups: no weight decay on biases, norm weights
    and embeddings.
    """
    module = load_model(model, model.path, vocab_size, attn, ds_config)
    if model.gradient_checkpointing:
        enable_gradient_checkpointing(module)
    if model.lora is not None:
        module = add_adapters(module, model.lora, seed=model.seed,
                              base=str(Path(model.path).resolve()) if model.path else None)
    groups = weight_decay_groups(module, weight_decay)
    policy, _, _, _ = deepspeed.initialize(model=module, model_parameters=groups, config=ds_config, mpu=mpu)
    if model.compile_layers:
        keep_hooks_eager(policy.module)
    start_schedule(policy)
    return policy


def build_reference(model: ModelSpec, offload: bool, whole: bool, ds_config: dict, vocab_size: int, attn: str,
                    mpu=None):
    """The frozen reference (``--ref-model`` or the policy's own weights): a ZeRO-3 engine, or a plain module;
    its parameters offloaded (--ref-offload) or kept whole (--ref-whole)."""
    ref_ds = reference_ds_config(ds_config, offload, whole=whole)
    return _frozen(model, model.reference or model.path, ref_ds, vocab_size, attn, mpu)


def build_evaluated_policy(model: ModelSpec, ds_config: dict, vocab_size: int, attn: str, mpu=None):
    """``eval``: the policy (--model) forward only, built like the reference (no optimizer, no gradients)."""
    return _frozen(model, model.path, reference_ds_config(ds_config, offload=False), vocab_size, attn, mpu)


def _frozen(model: ModelSpec, path: str | None, ref_ds: dict, vocab_size: int, attn: str, mpu):
    """A forward-only model in eval mode under ``ref_ds`` (a reference_ds_config): a ZeRO-3 engine, or a plain module."""
    module = load_model(model, path, vocab_size, attn, ref_ds)
    module.eval()
    module.requires_grad_(False)
    if zero_stage(ref_ds) == 3:
        engine, _, _, _ = deepspeed.initialize(model=module, config=ref_ds, mpu=mpu)
        engine.eval()
        if model.compile_layers:
            keep_hooks_eager(engine.module)
        return engine
    # ZeRO 0-2 shard only optimizer state and gradients; a frozen model has neither, so it stays whole.
    return module.to(get_accelerator().current_device_name())


def model_config(model: ModelSpec, vocab_size: int, own_tokenizer: bool = True):
    """The policy's HF config alone (cheap: no weights; a hub id fetches its config.json into the hub cache);
    ``own_tokenizer``: the run's tokenizer is the model folder's (no --tokenizer)."""
    if model.path is not None:
        config = load_pretrained_config(model.path, "--model", model.revision, model.trust_remote_code)
        check_model_folder(model.path, config, vocab_size, own_tokenizer=own_tokenizer)
    else:
        config = load_model_config(model.built_config, vocab_size, check_buildable=True)
    check_forward_rules(config, model.source)
    return config


def reference_model_config(model: ModelSpec, vocab_size: int, own_tokenizer: bool = True):
    """The reference's HF config: --ref-model's, else the policy's."""
    if model.reference is not None:
        config = load_pretrained_config(model.reference, "--ref-model", None, model.trust_remote_code)
        check_model_folder(model.reference, config, vocab_size, own_tokenizer=False, where="--ref-model")
        check_forward_rules(config, f"--ref-model {model.reference}")
        return config
    return model_config(model, vocab_size, own_tokenizer)
