"""A per-GPU memory estimate of a run, from phase one alone (``ds-packdpo train --dry-run``).

Model states come from DeepSpeed's own ZeRO-3 estimator
(``estimate_zero3_model_states_mem_needs``: 18 bytes per parameter over the ranks in
mixed precision -- 16-bit weights and gradients, fp32 master weights and Adam moments --
plus the largest layer gathered), fed with the policy's trainable parameter counts taken
from its skeleton on the meta device (with its LoRA adapters, when --lora-r adds them),
with the offload the DeepSpeed config asks for. Frozen weights (a LoRA run's whole base)
have no gradient, master copy or optimizer state: they count as weights alone, in
--dtype, partitioned like the rest. The frozen reference adds its weights' share. No
library estimates a packed row's activations, so they are counted here per token and
decoder layer from the model config: what autograd keeps of a pre-norm decoder layer
(norm inputs and outputs, q/k/v before and after the rotary embedding, the attention
output, the MLP's gate, up, activation and product), at the row budget, plus the
gradients of one layer's activations while backward runs it; with activation
checkpointing each layer keeps only its input, and one layer's activations exist again
while it is recomputed. The log-prob chunk is the fp32 logits of --logps-chunk-tokens
tokens (the whole row with --logps-impl plain), kept with their log-softmax and
gradient.
"""

from __future__ import annotations

import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from transformers import AutoModelForCausalLM

from .assemble import RunSetup
from ..model.logps import LOGPS_IMPLEMENTATIONS, auto_chunk_tokens
from ..model.lora import LoraSettings, add_adapters
from .engines import model_config, reference_model_config, zero_stage

GIB = 2**30


def parameter_counts(hf_config, trust_remote_code: bool = False, lora: LoraSettings | None = None
                     ) -> tuple[int, int, int]:
    """(total parameters, the largest module's own parameters, trainable parameters) of a model, built on the meta
    device (no memory), with ``lora``'s adapters when given (then only they train); shared weights are counted once,
    as DeepSpeed's ``model_to_params`` does."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
        if lora is not None:
            model = add_adapters(model, lora)
    parameters = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in parameters)
    trainable = sum(p.numel() for p in parameters if p.requires_grad)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest, trainable


# Adam's fp32 master weight and two moments: the optimizer's part of DeepSpeed's 18 bytes per trained parameter
OPTIMIZER_BYTES_PER_PARAMETER = 12


def layer_activation_elements(hf_config) -> int:
    """Elements one token keeps for backward in one decoder layer (see the module docstring)."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    intermediate = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    return 4 * hidden + 3 * heads * head_dim + 3 * kv_heads * head_dim + 4 * intermediate


def estimate_memory(setup: RunSetup) -> dict:
    """The per-GPU estimate of ``setup``'s run in bytes: model states, activations with and without activation
    checkpointing (the run's choice marked), the log-prob chunk, and the totals."""
    spec, ds = setup.spec, setup.ds_config
    model = spec.model
    hf_config = model_config(model, setup.vocab_size, own_tokenizer=spec.data.tokenizer is None)
    total, largest, trainable = parameter_counts(hf_config, model.trust_remote_code, model.lora)
    frozen = total - trainable
    zero = ds.get("zero_optimization", {})
    offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    offload_params = zero.get("offload_param", {}).get("device", "none") not in ("none", None)
    world = spec.layout.world_size
    element = 2 if model.dtype == "bf16" else 4
    stage3 = zero_stage(ds) == 3
    # the trained parameters' states; frozen ones are weights alone, partitioned (ZeRO-3) or whole (0-2)
    _, states, _ = estimate_zero3_model_states_mem_needs(trainable, largest, num_gpus_per_node=world,
                                                         cpu_offload=offload_optimizer,
                                                         cpu_offload_params=offload_params and stage3)
    if stage3:
        frozen_weights = 0 if offload_params else frozen * element // world
    else:  # ZeRO 0-2: as stage 3 (the sharded states), plus whole 16-bit weights on every rank
        states += 2 * trainable
        frozen_weights = frozen * element
    optimizer = 0 if offload_optimizer else OPTIMIZER_BYTES_PER_PARAMETER * trainable // world
    states += frozen_weights
    reference = 0
    if setup.precomputed is None and spec.loss.needs_reference and not (model.lora and model.reference is None):
        ref_total = total if model.reference is None else parameter_counts(reference_model_config(
            model, setup.vocab_size), model.trust_remote_code)[0]
        sharded = stage3 and not spec.reference.whole  # --ref-whole: every rank holds all of it
        reference = 0 if spec.reference.offload else ref_total * element // (world if sharded else 1)
    tokens = spec.plan.row_budget
    layers = hf_config.num_hidden_layers
    per_layer = tokens * layer_activation_elements(hf_config) * element
    # backward holds the gradients of one layer's activations as it runs; a recomputed layer's own come on top
    activations = {"full": (layers + 1) * per_layer + 2 * tokens * hf_config.hidden_size * element,
                   "checkpointed": layers * tokens * hf_config.hidden_size * element + 2 * per_layer}
    chunk = spec.logps.chunk_tokens
    if chunk == "auto":  # what the lean head will pick for a full row (model/logps.auto_chunk_tokens)
        chunk = auto_chunk_tokens(tokens, hf_config.hidden_size, hf_config.vocab_size, element)
    # plain holds the whole row's logits, lean one chunk's, fused none (cut-cross-entropy works in on-chip memory)
    held = LOGPS_IMPLEMENTATIONS[spec.logps.impl].logits_held
    chunk_tokens = {"row": tokens, "none": 0, "chunk": min(chunk, tokens)}[held]
    logps_chunk = 3 * chunk_tokens * hf_config.vocab_size * 4
    kept = "checkpointed" if model.gradient_checkpointing else "full"
    return {"parameters": total, "trainable_parameters": trainable, "largest_layer_parameters": largest,
            "world_size": world, "row_tokens": tokens, "model_states": int(states),
            "optimizer_states": optimizer, "frozen_weights": frozen_weights, "reference_weights": int(reference),
            "activations": activations, "activation_checkpointing": model.gradient_checkpointing,
            "logps_chunk": logps_chunk,
            "total": int(states + reference + activations[kept] + logps_chunk),
            "total_other_checkpointing": int(states + reference + activations["full" if kept != "full"
                                                                              else "checkpointed"] + logps_chunk)}


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _trained(estimate: dict) -> str:
    """What the model states count: every parameter trained, or the trained ones and the frozen weights apart."""
    total, trainable, world = estimate["parameters"], estimate["trainable_parameters"], estimate["world_size"]
    if trainable == total:
        return f"{total:,} parameters over {world} ranks"
    return (f"{trainable:,} trainable of {total:,} parameters over {world} ranks, their optimizer states "
            f"{_size(estimate['optimizer_states'])}; frozen weights {_size(estimate['frozen_weights'])}")


def describe_estimate(estimate: dict) -> str:
    """The estimate in one line, per GPU."""
    acts = estimate["activations"]
    on = estimate["activation_checkpointing"]
    return (f"memory per GPU (estimate): {_size(estimate['total'])} = model states {_size(estimate['model_states'])} "
            f"(ZeRO-3 estimator, {_trained(estimate)}) + "
            f"reference "
            f"{_size(estimate['reference_weights'])} + activations {_size(acts['checkpointed' if on else 'full'])} "
            f"({estimate['row_tokens']} tokens a row, {'with' if on else 'without'} activation checkpointing) + "
            f"log-prob chunk {_size(estimate['logps_chunk'])}; {'without' if on else 'with'} activation checkpointing "
            f"{_size(estimate['total_other_checkpointing'])}")
