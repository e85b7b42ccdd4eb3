"""TR-DPO: the reference mixed toward the policy every N optimizer steps (TRL 1.16's ``sync_ref_model``).

Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment" (arXiv 2404.09656), soft update:
after optimizer step s with s % N == 0, parameter by parameter,

    ref <- alpha * policy + (1 - alpha) * ref

(TRL's ``SyncRefModelCallback``: ``ref_model_mixup_alpha`` alpha, ``ref_model_sync_steps`` N, run at every step's
end).  TRL under ZeRO-3 gathers both whole models onto rank 0 to mix them; here each rank mixes its own partitions:
the policy engine and the reference engine partition the same architecture over the same ranks, so a parameter's
partition (``param.ds_tensor``) covers the same elements in both, and the elementwise mix of the partitions is the
partition of the mix.  Nothing is gathered, no collective runs.  Under ZeRO 0-2 the parameters are whole on every
rank and are mixed as they are.

Which policy values: the module's parameters, the weights the policy's forward runs with (TRL's choice too): in
fp32 they are the optimizer's master weights; in bf16 training they are the bf16 copies, and the reference (held in
bf16 like the policy) could not keep the master's extra bits anyway.  The mix is computed in fp32 as
``ref * (1 - alpha) + policy * alpha``, three separately rounded elementwise operations (no fused multiply-add),
so a partition mixes to exactly the elements a whole tensor would, and is rounded once to the reference's dtype.

A skipped step (non-finite loss or gradient: the policy did not move) still counts towards N and mixes on schedule,
as TRL's callback does: the policy's weights are the previous step's, finite, and the mixing steps stay the global
steps the LR schedule also counts, whatever was skipped.

The mixed reference is state: every checkpoint holds it (``reference_rank{r}.safetensors``: under ZeRO-3 each
rank's partitions, else rank 0's whole copy), and a resume loads it back, so a resumed TR-DPO run continues
exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ..errors import InputError
from ..model.build import ModelSpec
from .engines import reference_model_config

REFERENCE_FILE = "reference_rank{rank}.safetensors"


@dataclass(frozen=True)
class RefSync:
    """--sync-ref-model's settings: mix with ``alpha`` after every ``every``-th optimizer step."""

    alpha: float  # --ref-model-mixup-alpha
    every: int  # --ref-model-sync-steps

    def due(self, global_step: int) -> bool:
        return global_step % self.every == 0

    def record(self) -> dict:
        """What a checkpoint records of it (a resume must continue with the same)."""
        return {"alpha": self.alpha, "every": self.every}


def reference_files(world_size: int, zero_stage: int) -> list[str]:
    """The reference files of a TR-DPO checkpoint: one per rank under ZeRO-3 (its partitions), else rank 0's."""
    return [REFERENCE_FILE.format(rank=rank) for rank in range(world_size if zero_stage == 3 else 1)]


def parameter_shapes(hf_config, trust_remote_code: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter's name and shape of the model ``hf_config`` describes, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    return [(name, tuple(param.shape)) for name, param in model.named_parameters()]


def check_mixable(policy_config, reference_config, ref_model: str, trust_remote_code: bool) -> None:
    """Phase one: --ref-model has the policy's parameters, name by name and shape by shape (else no mix exists)."""
    policy = dict(parameter_shapes(policy_config, trust_remote_code))
    reference = dict(parameter_shapes(reference_config, trust_remote_code))
    if policy == reference:
        return
    differing = [name for name, shape in policy.items() if reference.get(name) != shape]
    if not differing:
        why = f"it has {sorted(set(reference) - set(policy))[0]}, which the policy has not"
    elif differing[0] not in reference:
        why = f"it has no {differing[0]}"
    else:
        why = f"its {differing[0]} is {list(reference[differing[0]])}, the policy's {list(policy[differing[0]])}"
    raise InputError(f"--sync-ref-model with --ref-model {ref_model}: the reference must have the policy's "
                     f"architecture to be mixed into ({why})")


def check_sync_settings(sync: RefSync | None, model: ModelSpec, command: str, raw_ds: dict, policy_config,
                        vocab_size: int) -> None:
    """Phase one of --sync-ref-model (how it fits the run's other settings is the run's settings' own check,
    ``assemble.RunSpec``): only ``train`` moves the reference; the policy's partitions must be in memory to be read; a
    --ref-model must have the policy's parameters."""
    if sync is None:
        return
    if command != "train":
        raise InputError(f"--sync-ref-model: {command} runs a fixed reference; only train mixes it toward the policy")
    zero = raw_ds.get("zero_optimization", {})
    if zero.get("offload_param", {}).get("device") == "nvme":
        raise InputError("--sync-ref-model with parameters offloaded to NVMe ('zero_optimization.offload_param.device': "
                         "nvme): the policy's partitions are mixed from memory; offload to cpu or not at all")
    # Each keeps a second form of a partition (hpZ: a node-local copy gathered from; quantized: int8 with scales) that
    # a mix of ``ds_tensor`` would leave stale.
    for key in ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        if zero.get(key) not in (None, False, 0, 1):
            raise InputError(f"--sync-ref-model with 'zero_optimization.{key}': {zero[key]!r}: the reference is mixed "
                             f"in its plain ZeRO-3 partitions; remove the key")
    if model.reference is not None:
        check_mixable(policy_config, reference_model_config(model, vocab_size), model.reference,
                      model.trust_remote_code)


def _module(model) -> torch.nn.Module:
    return model.module if isinstance(model, DeepSpeedEngine) else model


def _zero3(param) -> bool:
    return hasattr(param, "ds_tensor")


class ReferenceSync:
    """Mixes a run's reference toward its policy on schedule, and saves and loads the mixed reference."""

    def __init__(self, settings: RefSync, policy, reference):
        self.settings = settings
        self.reference = reference
        self.pairs = paired_parameters(_module(policy), _module(reference))

    @classmethod
    def of(cls, run) -> ReferenceSync | None:
        """The run's sync (None without --sync-ref-model)."""
        settings = run.setup.spec.reference.sync
        return None if settings is None else cls(settings, run.policy, run.reference)

    def after_step(self, global_step: int) -> bool:
        """Mixes when ``global_step`` is due; returns whether it did."""
        if not self.settings.due(global_step):
            return False
        self.release_gathered()
        mix_into_reference(self.pairs, self.settings.alpha)
        return True

    def release_gathered(self) -> None:
        """ZeRO-3, before the partitions change: every reference parameter still gathered (the small persistent
        ones stay whole between forwards; a prefetch may be in flight) is released, so the next forward gathers the
        new partitions instead of running the old whole copy."""
        offload = getattr(self.reference, "optimizer", None)
        if offload is not None and hasattr(offload, "partition_all_parameters"):
            offload.partition_all_parameters()

    def save(self, tag_dir: Path, rank: int) -> Path | None:
        """This rank's reference file in the checkpoint (ZeRO-3: its partitions; else rank 0 only, the whole)."""
        zero3 = _zero3(self.pairs[0][2]) if self.pairs else False
        if not zero3 and rank != 0:
            return None
        path = tag_dir / REFERENCE_FILE.format(rank=rank)
        save_file({name: local_values(ref).detach().to("cpu").clone().contiguous()
                   for name, _, ref in self.pairs}, str(path), metadata={"format": "pt"})
        return path

    @torch.no_grad()
    def load(self, tag_dir: Path, rank: int) -> None:
        """Puts the checkpoint's mixed reference back (a tensor's shape checked against this rank's)."""
        zero3 = _zero3(self.pairs[0][2]) if self.pairs else False
        path = tag_dir / REFERENCE_FILE.format(rank=rank if zero3 else 0)
        saved = load_file(str(path))
        self.release_gathered()
        if set(saved) != {name for name, _, _ in self.pairs}:
            raise RuntimeError(f"{path}: holds other parameters than the reference's")
        for name, _, ref in self.pairs:
            target = local_values(ref)
            if saved[name].shape != target.shape or saved[name].dtype != target.dtype:
                raise RuntimeError(f"{path}: {name} is {saved[name].dtype} {list(saved[name].shape)}, the reference's "
                                   f"{target.dtype} {list(target.shape)}")
            target.copy_(saved[name])


def local_values(param) -> torch.Tensor:
    """The values of ``param`` this rank holds: its ZeRO-3 partition, else the whole tensor."""
    return param.ds_tensor if _zero3(param) else param.data


def paired_parameters(policy: torch.nn.Module, reference: torch.nn.Module) -> list[tuple[str, object, object]]:
    """(name, policy parameter, reference parameter) for every parameter, after checking that both modules hold the
    same parameters, partitioned alike (phase one checked the architectures; this checks the partitions)."""
    pol, ref = dict(policy.named_parameters()), dict(reference.named_parameters())
    if set(pol) != set(ref):
        raise RuntimeError(f"--sync-ref-model: the policy's and the reference's parameters differ "
                           f"({sorted(set(pol) ^ set(ref))[:3]})")
    pairs = []
    for name, p in pol.items():
        r = ref[name]
        if _zero3(p) != _zero3(r) or (_zero3(p) and (p.ds_numel != r.ds_numel or p.ds_shape != r.ds_shape)):
            raise RuntimeError(f"--sync-ref-model: {name} is partitioned differently in the policy and the reference")
        pol_local, ref_local = local_values(p), local_values(r)
        if pol_local.shape != ref_local.shape:
            raise RuntimeError(f"--sync-ref-model: {name}: this rank holds {list(pol_local.shape)} of the policy and "
                               f"{list(ref_local.shape)} of the reference")
        pairs.append((name, p, r))
    return pairs


@torch.no_grad()
def mix_into_reference(pairs: list[tuple[str, object, object]], alpha: float) -> None:
    """ref <- ref * (1 - alpha) + policy * alpha on this rank's values of every parameter, in fp32, in place (ZeRO-3:
    on the partitions of released parameters, ``ReferenceSync.release_gathered``)."""
    for _, pol, ref in pairs:
        if _zero3(ref) and ref.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise RuntimeError("--sync-ref-model: a reference parameter is gathered while its partition is mixed")
        target = local_values(ref)
        source = local_values(pol).to(device=target.device, dtype=torch.float32)
        mixed = target.to(torch.float32) * (1.0 - alpha)
        mixed = mixed + source * alpha
        target.copy_(mixed)
