"""One rank of the activation-checkpointing and parameter-group check (launched by tests/test_scale.py).

``deepspeed --num_gpus 2 tests/checkpointing_check.py OUT.json [train flags]``: the run is
assembled as training assembles it (``--gradient-checkpointing`` among the flags, ZeRO-3,
packed rows, lean log-probs, sequence parallelism when asked).  For the first rows of step
1 it computes the DPO loss's gradient with checkpointing on (as built) and off
(``activation_checkpointing_disable`` on the same engine, so the weights are the same),
assembles every parameter's full gradient from DeepSpeed's partitions and counts the
forward calls of one decoder layer's MLP (twice per row when the layer is recomputed in
backward).  Then one optimizer step with zero gradients shows what the optimizer DeepSpeed
built does with weight decay alone: AdamW scales each decayed weight by (1 - lr x decay)
and leaves the rest.  Rank 0 writes the figures as JSON.
"""

from __future__ import annotations

import torch
from deepspeed import zero
from deepspeed.utils import safe_get_full_grad
from launching import rank_check_main, write_rank_report

from ds_packdpo.config import parse_train_args
from ds_packdpo.data.run_plan import run_plan
from ds_packdpo.model.losses import global_normalized_loss, pair_losses
from ds_packdpo.model.param_groups import no_decay_names
from ds_packdpo.run.assemble import prepare, start

ROWS = 2


def step_gradients(run, rows, plan) -> list[torch.Tensor]:
    """The full gradient of every parameter after the rows' DPO losses (one optimizer step's worth, not applied)."""
    policy = run.policy
    for i, row in enumerate(rows):
        batch = run.row_batch(row, plan)
        reference = run.reference_logps(batch)
        policy.set_gradient_accumulation_boundary(i == len(rows) - 1)
        losses, _ = pair_losses(run.forward_logps(policy, batch), reference, run.setup.spec.loss)
        policy.backward(global_normalized_loss(losses, plan.num_pairs, run.setup.spec.layout.gradient_divisor),
                        scale_wrt_gas=False)
    grads = [safe_get_full_grad(p).detach().clone() for p in policy.module.parameters()]
    policy.optimizer.zero_grad()
    return grads


def full_parameters(module) -> dict[str, torch.Tensor]:
    params = dict(module.named_parameters())
    with zero.GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}


def main(out_path: str, flags: list[str]) -> None:
    setup = prepare(parse_train_args(flags), "train")
    run = start(setup)
    policy, layout = run.policy, setup.spec.layout
    plan = next(run_plan(setup.prepared, setup.spec.plan.config, 1))
    rows = plan.ranks[layout.dp_rank][:ROWS]
    assert len({len(r[:ROWS]) for r in plan.ranks}) == 1  # the same number of forwards on every rank

    calls = [0]
    # a pre-hook: the recomputation stops (early) inside the MLP, once the last saved tensor it needs exists
    policy.module.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    report = {"checkpointing_enabled": policy.module.is_activation_checkpointing, "rows": len(rows)}
    grads = {}
    for mode in ("on", "off"):
        calls[0] = 0
        grads[mode] = step_gradients(run, rows, plan)
        report[f"mlp_calls_{mode}"] = calls[0]
        policy.module.activation_checkpointing_disable()
    worst = max(float((a - b).abs().max()) for a, b in zip(grads["on"], grads["off"], strict=True))
    scale = max(float(g.abs().max()) for g in grads["off"])
    report.update(grad_max_abs_diff=worst, grad_scale=scale, grad_max_rel_diff=worst / scale)

    # weight decay through DeepSpeed's optimizer: one step on zero gradients
    report["group_weight_decay"] = [group["weight_decay"] for group in policy.optimizer.param_groups]
    before = full_parameters(policy.module)
    lr = policy.get_lr()[0]
    batch = run.row_batch(rows[0], plan)
    policy.set_gradient_accumulation_boundary(True)
    policy.backward(run.forward_logps(policy, batch).logps.sum() * 0.0, scale_wrt_gas=False)
    policy.step()
    after = full_parameters(policy.module)
    exempt = no_decay_names(policy.module)
    factor = 1.0 - lr * setup.spec.optimizer.weight_decay
    report["decayed_max_rel_error"] = max(float((after[n] - before[n] * factor).abs().max() / before[n].abs().max())
                                          for n in before if n not in exempt)
    report["exempt_max_change"] = max(float((after[n] - before[n]).abs().max()) for n in exempt)
    report["exempt"] = sorted(exempt)
    write_rank_report(run, report, out_path)


if __name__ == "__main__":
    rank_check_main(main)
