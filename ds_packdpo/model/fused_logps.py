"""Per-token log-probs from a fused linear-cross-entropy kernel (Apple's cut-cross-entropy), on CUDA.

The lean path (:mod:`.logps`) never holds the row's ``[T, V]`` logits, but each chunk's logits and their
gradient exist for a moment.  cut-cross-entropy's Triton kernel computes ``log_softmax(h @ W.T)[target]`` and
its gradients blockwise in on-chip memory, so no logits exist at all: the stage's memory is its floor, the
hidden states and the head's weight gradient.  It is an optional extra (``pip install -e '.[fused]'``: Triton,
CUDA only), imported here once; ``--logps-impl auto`` takes it on CUDA when it is installed and the model
allows it, and lean otherwise.  Called with ``reduction="none"`` (a log-prob per token, which the segment
reduction sums in fp64 per sequence) and ``filter_eps=None``: its default skips the gradient of vocabulary
entries whose probability falls below a threshold, an approximation this trainer does not make.

What it cannot do (``model.logps.LOGPS_IMPLEMENTATIONS``' fused row) is given way to (``auto``) or refused in
phase one (``fused`` written): a LoRA adapter on the lm_head (its low-rank term is not part of the kernel's
matmul), a final-logit soft-cap (Gemma: the kernel caps its cross-entropy, but the ``logits/*`` metric below
assumes a linear head), an lm_head bias and a device other than CUDA.
"""

from __future__ import annotations

import torch

try:
    from cut_cross_entropy import linear_cross_entropy
except ImportError:  # the optional extra; Triton needs CUDA
    linear_cross_entropy = None

FUSED = "fused"


def kernel_missing() -> str | None:
    """Why this install has no fused kernel (None: it has one)."""
    if linear_cross_entropy is None:
        return "cut-cross-entropy is not installed (pip install -e '.[fused]'; CUDA with Triton only)"
    return None


def fused_token_logps(selected: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                      squares: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log-prob of each target in fp64, each position's vocabulary-mean logit, WPO's ``log sum_v p_v^2`` in
    fp64 with ``squares`` else None) from the hidden states ``selected`` ``[N, H]`` and the head's ``weight``
    ``[V, H]``, with no ``[N, V]`` tensor (no entropy or argmax: the kernel holds no logits to take them from).

    WPO's term from the kernel's own output: the cross-entropy of the doubled hidden states is that of the doubled
    logits (doubling is exact in floating point), ``CE(2h) = logsumexp(2z) - 2 z_t``, so
    ``log sum_v p_v^2 = logsumexp(2z) - 2 logsumexp(z) = CE(2h) - 2 CE(h)``: one more forward-only call.

    The mean logit (TRL's ``logits/chosen`` metric) of a linear head is linear in the hidden state:
    ``mean_v(h . W_v) = h . mean_v(W_v)``, one matrix-vector product.  The mean over the vocabulary is taken in
    fp32 by the reduction itself (``dtype=``): ``weight.float()`` would copy the whole ``[V, H]`` head in fp32 at
    every forward (2 GiB at V = 128k, H = 4096), more than the logits this path exists not to hold.
    """
    token_logps = -linear_cross_entropy(selected, weight, targets, reduction="none", filter_eps=None)
    log_sum_sq = None
    with torch.no_grad():
        mean_logit = selected.float() @ weight.mean(dim=0, dtype=torch.float32)
        if squares:
            doubled = linear_cross_entropy(selected * 2, weight, targets, reduction="none", filter_eps=None)
            log_sum_sq = doubled.double() + 2 * token_logps.detach().double()
    return token_logps.double(), mean_logit, log_sum_sq
