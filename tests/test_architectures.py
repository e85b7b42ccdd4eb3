"""The architecture matrix: every tiny model of model.build.ARCHITECTURES x every CPU backend is exact or refused.

Exact means: per-sequence log-probs of a packed row, and the gradients of a loss of them, equal those of each
sequence run alone with transformers' eager attention (the model's own reference kernel, its sliding window and
soft-caps included), fp32, on sequences longer than the model's window.  Refused means: phase one stops with one
line naming the model, the feature and a backend that works, where transformers itself would refuse to build it.
Also here: the window / soft-cap kernel against transformers' mask rule, the guard catching a kernel that drops
the window, and the 2-rank ZeRO-3 launch that trains every architecture.
"""

from __future__ import annotations

import json

import pytest
import torch
from launching import ranks_script, run
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

from ds_packdpo.data.plan import RowLayout
from ds_packdpo.errors import InputError, PackingNotExactError
from ds_packdpo.model import attention
from ds_packdpo.model.attention import (VARLEN_IMPLEMENTATION, attend_sequence, causal_window_mask,
                                        check_model_attention)
from ds_packdpo.model.build import ARCHITECTURES, SLIDING_WINDOW, build_model, tiny_config
from ds_packdpo.model.guard import (HALF_ATOL_PER_TOKEN, NOISE_FACTOR, assert_packing_exact, guard_pairs,
                                   packing_exactness)
from ds_packdpo.model.matrix import VOCAB, matrix_outcome

CPU_BACKENDS = ("sdpa_varlen", "sdpa", "eager")
LOGPS_ATOL = 1e-5  # the bound on sums of sequences longer than the window (fp32)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: torch's thread pool costs more than it gives (25x slower here with 2 threads while other jobs
    held the cores), so the matrix runs on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(arch: str, attn: str):
    return build_model(None, f"tiny-{arch}", VOCAB, torch.float32, attn, seed=0)


@pytest.mark.parametrize("attn", CPU_BACKENDS)
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_matrix_packed_equals_eager_alone_or_is_refused(arch, attn):
    outcome = matrix_outcome(arch, attn)
    if outcome["verdict"] == "refused":
        message = outcome["message"]
        assert "\n" not in message and message.startswith(f"--attn {attn}: --model-config tiny-{arch}"), message
        assert "use --attn sdpa_varlen or eager" in message, message
        with pytest.raises(ValueError):  # transformers itself refuses it, only later (when building, in every rank)
            _model(arch, attn)
        return
    window = outcome["sliding_window"]
    assert window is None or outcome["shortest_sequence"] > window
    assert outcome["logps_diff"] <= LOGPS_ATOL, outcome
    assert outcome["grad_diff"] <= 1e-5 * outcome["grad_scale"], outcome


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_matrix_prefix_shared_rows_equal_eager_alone(arch):
    """sdpa_varlen's prefix-shared rows (each prompt once; prompts longer than the window, so the rejected block's
    window cuts into its prompt) against every sequence alone, eager: log-probs and gradients."""
    outcome = matrix_outcome(arch, "sdpa_varlen", layout=RowLayout.PREFIX_SHARED)
    assert outcome["verdict"] == "measured" and outcome["logps_diff"] <= LOGPS_ATOL, outcome
    assert outcome["grad_diff"] <= 1e-5 * outcome["grad_scale"], outcome


def test_every_refusal_is_what_transformers_refuses():
    """Only Gemma 2 + sdpa is refused on CPU (its attention soft-cap); every other pair builds and runs."""
    refused = []
    for arch in ARCHITECTURES:
        for attn in CPU_BACKENDS:
            try:
                check_model_attention(tiny_config(arch, vocab_size=VOCAB), attn, arch)
            except InputError as error:
                refused.append((arch, attn, str(error)))
    assert [(a, b) for a, b, _ in refused] == [("gemma2", "sdpa")]
    assert "soft-caps its attention scores (attn_logit_softcapping 0.05)" in refused[0][2]


def test_other_layer_kinds_are_refused_by_the_per_sequence_kernels():
    """Chunked attention, bidirectional or unknown layer kinds: sdpa_varlen (and Ulysses) refuse, naming eager."""
    for extra, feature in [({"attention_chunk_size": 16}, "attention_chunk_size"),
                           ({"layer_types": ["sliding_attention", "linear_attention"]}, "layer_types linear_attention")]:
        config = tiny_config("gemma3" if "layer_types" in extra else "llama", **extra)
        with pytest.raises(InputError) as info:
            check_model_attention(config, "sdpa_varlen", "--model m")
        assert feature in str(info.value) and "use --attn eager" in str(info.value)
        check_model_attention(config, "eager", "--model m")  # transformers' own kernel: its business


# ----------------------------------------------------------------------------- the kernel's rule


@pytest.mark.parametrize("q_len, k_len, window", [(9, 9, 4), (9, 9, None), (3, 9, 4), (5, 12, 7), (6, 6, 6)])
def test_window_mask_is_transformers_rule(q_len, k_len, window):
    """causal_window_mask == transformers' own mask (sliding_window_causal_mask_function), bottom-right aligned."""
    mask_function = sliding_window_causal_mask_function(window) if window else None
    kwargs = {"mask_function": mask_function} if window else {}
    want = sdpa_mask(batch_size=1, q_length=q_len, kv_length=k_len, q_offset=k_len - q_len, allow_is_causal_skip=False,
                     **kwargs)[0, 0]
    assert torch.equal(causal_window_mask(q_len, k_len, window), want)


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 0.5), (5, 0.5), (40, None)])
def test_attend_sequence_against_explicit_scores(window, softcap):
    """One sequence: the kernel equals softmax(cap(q k^T * scale)) over the window, written out here."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 13, 8, generator=g) for _ in range(3))
    scores = q @ k.transpose(-1, -2) * 0.3
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(13)[:, None], torch.arange(13)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    want = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v
    torch.testing.assert_close(attend_sequence(q, k, v, 0.3, window, softcap), want, rtol=0, atol=1e-6)
    # the last 4 queries against all 13 keys: the same rows
    torch.testing.assert_close(attend_sequence(q[:, :, 9:], k, v, 0.3, window, softcap), want[:, :, 9:], rtol=0,
                               atol=1e-6)


def test_fewer_queries_than_keys_backward():
    """The lower-right causal bias (no mask tensor; what a prefix-shared rejected block runs on CUDA): gradients of
    q, k and v equal those of the scores written out."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, requires_grad=True) for n in (4, 13, 13))
    i, j = torch.arange(9, 13)[:, None], torch.arange(13)[None, :]
    want = torch.softmax((q @ k.transpose(-1, -2) * 0.3).masked_fill(j > i, float("-inf")), dim=-1) @ v
    grad_out = torch.randn(want.shape, generator=g)
    expected = torch.autograd.grad(want, (q, k, v), grad_out)
    got = torch.autograd.grad(attend_sequence(q, k, v, 0.3), (q, k, v), grad_out)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- the guard


def _window_blind(module, query, key, value, attention_mask, sliding_window=None, **kwargs):
    """sdpa_varlen as it was before this change: the layer's sliding window swallowed."""
    return attention._own_kernel_forward("sdpa_varlen")(module, query, key, value, attention_mask, **kwargs)


def test_guard_catches_a_kernel_that_ignores_the_window():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("window_blind", _window_blind)
    AttentionMaskInterface.register("window_blind", attention._sdpa_varlen_mask)
    exact = _model("mistral", "sdpa_varlen")
    assert exact.config._attn_implementation == VARLEN_IMPLEMENTATION
    pairs = guard_pairs(exact, VOCAB)
    assert min(len(p["prompt_ids"]) for p in pairs) > SLIDING_WINDOW  # the guard's sequences exceed the window
    result = assert_packing_exact(exact, "sdpa_varlen", VOCAB, 0)
    assert result["ok"] and result["sliding_window"] == SLIDING_WINDOW and result["max_diff_per_token"] < 1e-6
    blind = _model("mistral", "window_blind")
    with pytest.raises(PackingNotExactError) as info:
        assert_packing_exact(blind, "window_blind", VOCAB, 0)
    assert "beyond their sliding window" in str(info.value) and "\n" not in str(info.value)
    assert blind.config._attn_implementation == "window_blind"  # the guard's eager run put the model back
    # in bf16 too, with its per-token tolerance (an exact kernel stays within it: the matrix in gpu_check), which
    # is at least NOISE_FACTOR x the model's own sdpa-vs-eager noise floor; Gemma 2 has no sdpa: the fixed bound
    assert result["noise_floor_per_token"] is None  # fp32: the fixed bound
    for arch in ("mistral", "qwen2-swa", "gemma2"):
        for attn, exact in (("sdpa_varlen", True), ("window_blind", False)):
            model = build_model(None, f"tiny-{arch}", VOCAB, torch.bfloat16, attn, seed=0)
            result = packing_exactness(model, guard_pairs(model, VOCAB), attn, 0)
            assert result["ok"] is exact, (arch, attn, result)
            floor = result["noise_floor_per_token"]
            assert (floor is None) == (arch == "gemma2"), (arch, result)
            assert result["tolerance_per_token"] == max(HALF_ATOL_PER_TOKEN, NOISE_FACTOR * (floor or 0.0))


# ----------------------------------------------------------------------------- 2 ranks, ZeRO-3, every architecture


@pytest.mark.multirank
def test_every_architecture_trains_on_two_zero3_ranks(tmp_path):
    """One launch (tests/arch_train_check.py): every architecture of the matrix trains one ZeRO-3 step on 2 ranks
    through the real assembly (--attn auto = sdpa_varlen, with its start-up guard); tiny Mistral and Gemma 3
    train 3 steps, and their step-1 policy log-probs equal an eager one-sequence-at-a-time computation."""
    out = tmp_path / "report.json"
    run(ranks_script(2, "tests/arch_train_check.py", str(tmp_path), str(out)), timeout=900)
    report = json.loads(out.read_text())
    assert sorted(report) == sorted(ARCHITECTURES)
    for arch, result in report.items():
        steps = result["metrics"]
        assert len(steps) == (3 if arch in ("mistral", "gemma3") else 1), arch
        assert result["attn"] == "sdpa_varlen" and result["guard"]["ok"], (arch, result["guard"])
        assert all(torch.isfinite(torch.tensor([s["loss"], s["grad_norm"]])).all() for s in steps), (arch, steps)
        assert abs(steps[0]["loss"] - 0.693147) < 1e-4, (arch, steps[0])  # policy = reference at step 1
        if arch in ("mistral", "gemma3"):
            assert result["longest"] > SLIDING_WINDOW
            # the metrics are fp32 sums over the step's pairs (all-reduced), then means: a few ulps of ~1,000 nats
            assert max(result["step1_logps_diff"]) <= 5e-7 * result["step1_logps_scale"], (arch, result)
            assert steps[-1]["loss"] < steps[0]["loss"], (arch, steps)


def test_masked_calls_leave_cudnn_out_on_cuda():
    """cuDNN's SDPA backward returned NaN query gradients with a mask tensor (pytorch#196678): masked calls on CUDA
    run with it disabled, and the other fused kernels on; CPU calls are left as they are."""
    from ds_packdpo.model.sequence_attention import mask_safe_kernels

    assert torch.backends.cuda.cudnn_sdp_enabled()
    with mask_safe_kernels(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with mask_safe_kernels(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()
