"""One rank of the TR-DPO check (launched by tests/test_trdpo.py).

``deepspeed --num_gpus 2 tests/trdpo_check.py OUT.json [train flags with --sync-ref-model]``: the run is assembled
and trained as ``train`` does it (``train_loop``: its records come back), then, on the trained engines:

1. the shard-wise mix against a full-tensor mix computed independently: every parameter of the policy and the
   reference gathered whole, mixed as whole tensors (ours, and TRL 1.16's own ``SyncRefModelCallback`` arithmetic),
   then the reference mixed partition by partition and gathered again;
2. a mix with alpha 1 makes the reference's log-probs of a row those of the policy, exactly (the small parameters
   ZeRO-3 keeps gathered between forwards included).

Rank 0 writes the figures as JSON.
"""

from __future__ import annotations

import torch
from checkpointing_check import full_parameters
from launching import rank_check_main, write_rank_report
from trl.trainer.callbacks import SyncRefModelCallback

from ds_packdpo.config import parse_train_args
from ds_packdpo.data.run_plan import run_plan
from ds_packdpo.run.assemble import prepare, start
from ds_packdpo.run.reference_sync import ReferenceSync, RefSync, mix_into_reference
from ds_packdpo.run.trainer import train_loop

ALPHA = 0.3


def main(out_path: str, flags: list[str]) -> None:
    setup = prepare(parse_train_args(flags), "train")
    run = start(setup)
    history = train_loop(run, {})
    policy, reference = run.policy.module, run.reference.module

    # 1. the shard-wise mix equals the whole-tensor one
    before_pol, before_ref = full_parameters(policy), full_parameters(reference)
    expected = {n: before_ref[n] * (1.0 - ALPHA) + before_pol[n] * ALPHA for n in before_ref}
    trl_target = torch.nn.ParameterList([torch.nn.Parameter(before_ref[n].clone()) for n in before_ref])
    SyncRefModelCallback._sync_target_model(
        torch.nn.ParameterList([torch.nn.Parameter(before_pol[n]) for n in before_ref]), trl_target, ALPHA)
    sync = ReferenceSync(RefSync(ALPHA, 1), run.policy, run.reference)
    assert sync.after_step(7)
    after_ref, after_pol = full_parameters(reference), full_parameters(policy)
    report = {
        "history": history,
        "parameters": len(expected),
        "persistent": sum(bool(getattr(p, "ds_persist", False)) for p in reference.parameters()),
        "partitioned": all(p.ds_tensor.numel() < p.ds_numel for p in reference.parameters() if not p.ds_persist),
        "before_max_diff": max(float((before_ref[n] - before_pol[n]).abs().max()) for n in expected),
        "mix_max_diff": max(float((after_ref[n] - expected[n]).abs().max()) for n in expected),
        "trl_max_diff": max(float((after_ref[n] - t.detach()).abs().max()) for n, t in zip(expected, trl_target)),
        "policy_unchanged": all(torch.equal(after_pol[n], before_pol[n]) for n in expected),
    }

    # 2. alpha 1: the reference becomes the policy
    sync.release_gathered()
    mix_into_reference(sync.pairs, 1.0)
    report["alpha1_weights_equal"] = all(torch.equal(a, b) for a, b in zip(full_parameters(reference).values(),
                                                                           full_parameters(policy).values()))
    plan = next(run_plan(setup.prepared, setup.spec.plan.config, 1))
    batch = run.row_batch(plan.ranks[setup.spec.layout.dp_rank][0], plan)
    with torch.no_grad():
        ref_logps = run.reference_logps(batch).logps
        pol_logps = run.forward_logps(run.policy, batch).logps
    report["alpha1_logps_max_diff"] = float((ref_logps - pol_logps).abs().max())
    write_rank_report(run, report, out_path)


if __name__ == "__main__":
    rank_check_main(main)
