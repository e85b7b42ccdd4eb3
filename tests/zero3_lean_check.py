"""One rank of the ZeRO-3 lean-vs-plain gradient check (launched by tests/test_reference.py).

Per model (untied and tied embeddings), a ZeRO-3 engine with every parameter
partitioned runs the same rows through plain, lean and fused log-probs (fused through
:func:`full_logits_cross_entropy` where cut-cross-entropy's CUDA kernel cannot run); after each
``engine.backward`` the full gradient of every parameter is assembled from
DeepSpeed's partitions.  The ranks get different numbers of completion tokens (and
one row gives rank 1 the dummy row with none), so the ranks make different numbers
of chunks.  It also counts, per row, the all-gathers that bring
the lm_head weight in (forward and backward apart).  Then the reference engine of
--ref-whole against the partitioned one: its parameters persistent, no gather in its
forward, the same log-probs.  Rank 0 writes the largest differences and the counts as JSON.
"""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import safe_get_full_grad
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

import torch.nn.functional as F

from ds_packdpo.model import fused_logps
from ds_packdpo.model.collate import collate_packed
from ds_packdpo.model.logps import forward_logps
from ds_packdpo.model.build import tiny_config
from ds_packdpo.model.guard import synthetic_pairs
from ds_packdpo.run.engines import reference_ds_config
from ds_packdpo.run.process_group import release_shm_buffer

DS_CONFIG = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
             "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True}
VOCAB = 300


def full_logits_cross_entropy(e, c, targets, reduction="mean", filter_eps="high", **_):
    """cut-cross-entropy's contract computed the plain way; the trainer must ask for exact per-token values."""
    assert reduction == "none" and filter_eps is None, (reduction, filter_eps)
    return F.cross_entropy(F.linear(e, c).float(), targets, reduction="none")


def full_grads(engine) -> list[torch.Tensor]:
    return [safe_get_full_grad(p).detach().clone() for p in engine.module.parameters()]


def count_gathers_of(module: torch.nn.Module, weight: torch.nn.Parameter) -> list[int]:
    """A counter of the all-gathers that fetch ``weight`` while it is partitioned, whoever asks: ZeRO's module
    hooks (``all_gather_coalesced`` on the module's parameters) or a direct ``all_gather``."""
    count = [0]
    for param in module.parameters():
        for name in ("all_gather", "all_gather_coalesced"):
            def counted(*args, _original=getattr(param, name), _param=param, **kwargs):
                listed = args[0] if args else kwargs.get("param_list", kwargs.get("params"))
                if any(p is weight for p in (listed or [_param])) and weight.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                    count[0] += 1
                return _original(*args, **kwargs)
            setattr(param, name, counted)
    return count


def whole_reference_check(rows) -> dict:
    """The reference engine partitioned and kept whole (run/engines.reference_ds_config, --ref-whole): whether every
    parameter is persistent, the lm_head gathers of a pass over the rows once ZeRO-3 has traced the forward (it
    releases even persistent parameters while it records the trace: the first two forwards), the log-probs."""
    found = {}
    for whole in (False, True):
        ref_ds = reference_ds_config(DS_CONFIG, offload=False, whole=whole)
        keep_alive = HfDeepSpeedConfig(ref_ds)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=VOCAB), attn_implementation="sdpa")
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model.eval(), config=ref_ds)
        del keep_alive
        gathers = count_gathers_of(engine.module, engine.module.lm_head.weight)
        for _ in range(3):
            traced = gathers[0]
            with torch.no_grad():
                logps = torch.cat([forward_logps(engine, collate_packed(pairs, list(range(len(pairs))), 0), "sdpa",
                                                 chunk_tokens=5, impl="lean").logps for pairs in rows])
        found[whole] = {"persistent": all(p.ds_persist for p in engine.module.parameters()),
                        "gathers": gathers[0] - traced, "logps": logps}
        engine.destroy()
    return {"persistent": [found[False]["persistent"], found[True]["persistent"]],
            "gathers": [found[False]["gathers"], found[True]["gathers"]],
            "logps": float((found[True]["logps"] - found[False]["logps"]).abs().max()),
            "logps_scale": float(found[False]["logps"].abs().max())}


def main(out_path: str) -> None:
    if not torch.cuda.is_available():
        fused_logps.linear_cross_entropy = full_logits_cross_entropy
    deepspeed.init_distributed(dist_backend="gloo")
    release_shm_buffer()
    rank = dist.get_rank()
    rows = [synthetic_pairs(3 if rank == 0 else 1, VOCAB, seed=10 + rank, max_tokens=20),
            synthetic_pairs(2, VOCAB, seed=20) if rank == 0 else []]
    report = {}
    for tied in (False, True):
        keep_alive = HfDeepSpeedConfig(DS_CONFIG)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=VOCAB, tie_word_embeddings=tied),
                                                 attn_implementation="sdpa")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
        del keep_alive
        gathers = count_gathers_of(engine.module, engine.module.lm_head.weight)
        worst = {"logps": 0.0, "logps_scale": 0.0, "grad": 0.0, "grad_scale": 0.0, "head_gathers": []}
        results = {}  # (row, impl) -> log-probs and full gradients
        for impls in (("plain", "lean"), ("fused",)):  # fused after: a third forward per row changes ZeRO-3's trace
            for index, pairs in enumerate(rows):
                batch = collate_packed(pairs, list(range(len(pairs))), 0)
                counts = {"completion_tokens": int((batch.labels != -100).sum())}
                for impl in impls:
                    before = gathers[0]
                    seqs = forward_logps(engine, batch, "sdpa", chunk_tokens=5, impl=impl)
                    loss = (seqs.logps * torch.linspace(-1.0, 1.0, seqs.logps.numel())).sum() / 100
                    middle = gathers[0]
                    engine.backward(loss)
                    counts[impl] = {"forward": middle - before, "backward": gathers[0] - middle}
                    results[index, impl] = seqs.logps.detach(), full_grads(engine)
                    engine.optimizer.zero_grad()
                if "lean" in impls:
                    worst["head_gathers"].append(counts)
        for index in range(len(rows)):
            plain, plain_grads = results[index, "plain"]
            for impl in ("lean", "fused"):
                logps, grads = results[index, impl]
                if plain.numel():
                    worst["logps"] = max(worst["logps"], float((plain - logps).abs().max()))
                    worst["logps_scale"] = max(worst["logps_scale"], float(plain.abs().max()))
                for want, got in zip(plain_grads, grads, strict=True):
                    worst["grad"] = max(worst["grad"], float((want - got).abs().max()))
                    worst["grad_scale"] = max(worst["grad_scale"], float(want.abs().max()))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, worst.pop("head_gathers"))
        worst["head_gathers"] = everyone  # [rank][row]
        report["tied" if tied else "untied"] = worst
        engine.destroy()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, whole_reference_check(rows))
    report["whole_reference"] = everyone  # [rank]
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(report, handle)
    dist.barrier()


if __name__ == "__main__":
    main(next(a for a in sys.argv[1:] if not a.startswith("--local_rank")))
