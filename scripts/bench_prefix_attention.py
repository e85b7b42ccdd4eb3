"""CPU time of the attention of one pair, forward + backward, with and without prefix sharing (README figures).

For prompt P, completions C = R: ``unshared`` is varlen_attention over the two sequences P + C and P + R (what a
packed row without prefix sharing runs), ``shared`` is shared_prefix_attention over the block [P | C | R] (the
fused log-sum-exp path), ``shared-masked`` the same block with one sdpa call under a lower-right causal mask for the
rejected queries (the simpler kernel it replaces).  1 thread, process CPU time, best of --repeats.

    .venv/bin/python scripts/bench_prefix_attention.py --prompt 1000 --completion 1000
"""

from __future__ import annotations

import argparse
import time

import torch

from ds_packdpo.model.attention import varlen_attention
from ds_packdpo.model.collate import PrefixLayout
from ds_packdpo.model.prefix_attention import shared_prefix_attention


def best_cpu_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--completion", type=int, default=1000)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    p, c = args.prompt, args.completion
    layout = PrefixLayout(((p, c, c),))

    def run(tokens: int, attend):
        q = torch.randn(tokens, args.heads, args.head_dim, requires_grad=True)
        k, v = (torch.randn(tokens, args.kv_heads, args.head_dim, requires_grad=True) for _ in range(2))
        return lambda: attend(q, k, v).sum().backward()

    def masked(q, k, v):  # the rejected block as one sdpa call over [prompt | rejected] keys, lower-right mask
        groups = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(groups, dim=1).transpose(0, 1)[None] for t in (k, v))
        q = q.transpose(0, 1)[None]
        chosen = torch.nn.functional.scaled_dot_product_attention(q[:, :, :p + c], k[:, :, :p + c], v[:, :, :p + c],
                                                                  is_causal=True)
        keys = [torch.cat([t[:, :, :p], t[:, :, p + c:]], dim=2) for t in (k, v)]
        visible = torch.ones(c, p + c, dtype=torch.bool).tril(diagonal=p)
        rejected = torch.nn.functional.scaled_dot_product_attention(q[:, :, p + c:], *keys, attn_mask=visible)
        return torch.cat([chosen, rejected], dim=2)

    figures = {
        "unshared": best_cpu_seconds(run(2 * (p + c), lambda q, k, v: varlen_attention(q, k, v, [0, p + c, 2 * (p + c)])),
                                     args.repeats),
        "shared": best_cpu_seconds(run(p + 2 * c, lambda q, k, v: shared_prefix_attention(q, k, v, layout)),
                                   args.repeats),
        "shared-masked": best_cpu_seconds(run(p + 2 * c, masked), args.repeats),
    }
    print({name: round(seconds * 1e3, 1) for name, seconds in figures.items()}, "ms")


if __name__ == "__main__":
    main()
