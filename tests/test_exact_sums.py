"""Per-sequence log-prob sums are fp64 from the segment reduction to the loss and in the precomputed reference file:
`precompute-ref` and the live step-1 loss against an fp64 plain-HF computation at 512 and 16k tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from launching import ranks_module, read_metrics, run

from ds_packdpo.errors import InputError
from ds_packdpo.run.reference import FORMAT_VERSION, RECORD_KEYS, PrecomputedReference, write_reference

LONG_WORDS = {"short": 500, "long": 15700}  # completion words: ~512 and ~16.4k tokens with the synthetic tokenizer
MAX_LENGTH = 17000


def long_pairs_dataset(path: Path) -> Path:
    """Two pairs with ~512-token completions and one with ~16k-token completions, in the synthetic set's words."""
    from ds_packdpo.data.synthetic import synthetic_preference_rows

    rows = synthetic_preference_rows(48, seed=0)
    words = " ".join(m["content"].rstrip(".") for row in rows for m in row["chosen"] + row["rejected"]).split()
    rng = np.random.default_rng(0)

    def text(count: int) -> str:  # independent draws: chosen and rejected share no run of tokens to cancel errors
        return " ".join(rng.choice(words, size=count)) + "."

    records = [{"prompt": [{"role": "user", "content": text(20)}],
                "chosen": [{"role": "assistant", "content": text(count)}],
                "rejected": [{"role": "assistant", "content": text(count - 9)}]}
               for count in (LONG_WORDS["short"], LONG_WORDS["short"] + 11, LONG_WORDS["long"])]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def save_long_model(folder: Path, seed: int) -> Path:
    """A tiny random one-layer Llama (positions up to MAX_LENGTH) with the synthetic set's tokenizer, as an HF folder."""
    from ds_packdpo.data.synthetic import default_tokenizer, synthetic_preference_rows
    from ds_packdpo.model.build import tiny_config
    from transformers import AutoModelForCausalLM

    tokenizer = default_tokenizer(synthetic_preference_rows(48, seed=0))
    torch.manual_seed(seed)
    config = tiny_config(vocab_size=len(tokenizer), layers=1, max_position_embeddings=MAX_LENGTH)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def fp64_sums(flags: list[str], folder: Path) -> dict[int, tuple[float, float, int, int]]:
    """The oracle: the HF model of ``folder`` in fp64, each sequence alone (prompt + completion, no packing, no
    DeepSpeed), full fp64 log_softmax and sum.  pair_id -> (chosen, rejected, chosen tokens, rejected tokens)."""
    from transformers import AutoModelForCausalLM

    from ds_packdpo.config import parse_train_args
    from ds_packdpo.data.source import prepare_run_data, tokenizer_and_rows

    data = parse_train_args(flags).data_spec()
    prepared = prepare_run_data(data.tokenization, *tokenizer_and_rows(data))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="sdpa").eval()
    result = {}
    for record in prepared.dataset:
        prompt = list(record["prompt_ids"])
        sums = []
        for completion in (record["chosen_ids"], record["rejected_ids"]):
            ids = torch.tensor([prompt + list(completion)])
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1]
            sums.append(float(torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None]).sum()))
        result[int(record["pair_id"])] = (*sums, len(record["chosen_ids"]), len(record["rejected_ids"]))
    return result


def dpo_loss(policy: dict, reference: dict, beta: float) -> float:
    """TRL's sigmoid DPO loss, mean over pairs, in fp64 (math.log1p/exp on Python floats)."""
    losses = []
    for pair_id, (chosen, rejected, *_) in policy.items():
        ref_chosen, ref_rejected, *_ = reference[pair_id]
        margin = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
        losses.append(math.log1p(math.exp(-margin)) if margin > -30 else -margin)
    return sum(losses) / len(losses)


@pytest.mark.multirank
def test_precomputed_sums_and_live_loss_equal_fp64_plain_hf_at_16k_tokens(tmp_path):
    """1 rank (two launches), fp32, default lean log-probs and attention: the precomputed reference file holds the
    reference model's fp64 sums within 1e-5 nats of the fp64 oracle on ~512-token completions and 1e-4 on ~16k-token
    ones (Parquet double columns); the live step-1 loss (policy and reference engines, 3 pairs in one step) equals
    the fp64 oracle's loss to 1e-6 relative.  fp32 sums (the old file) were 2.6e-4 nats off at 512 tokens, and an
    fp32 16k-token sum's spacing is 8e-3 nats."""
    policy, reference = save_long_model(tmp_path / "policy", 0), save_long_model(tmp_path / "reference", 1)
    flags = ["--model", str(policy), "--ref-model", str(reference), "--dataset",
             str(long_pairs_dataset(tmp_path / "long.jsonl")), "--cache-dir", str(tmp_path / "cache"),
             "--max-length", str(MAX_LENGTH), "--max-tokens-per-row", str(2 * MAX_LENGTH + 64),
             "--global-batch-pairs", "3", "--dtype", "fp32", "--no-progress", "--overwrite"]
    training = ["--max-steps", "1", "--lr", "1e-3"]  # precompute-ref refuses them (it trains nothing)
    out = tmp_path / "ref.parquet"
    run(ranks_module(1, "ds_packdpo.precompute_ref", "--out", str(out), *flags))
    assert all(pa.types.is_float64(pq.read_schema(out).field(k).type) for k in ("chosen_logps", "rejected_logps"))
    stored = pq.read_table(out).to_pydict()
    want = fp64_sums(flags, reference)
    lengths, worst = [], {}
    for row in range(len(stored["pair_id"])):
        chosen, rejected, chosen_tokens, rejected_tokens = want[stored["pair_id"][row]]
        assert (stored["chosen_tokens"][row], stored["rejected_tokens"][row]) == (chosen_tokens, rejected_tokens)
        for got, expected, tokens in ((stored["chosen_logps"][row], chosen, chosen_tokens),
                                      (stored["rejected_logps"][row], rejected, rejected_tokens)):
            lengths.append(tokens)
            worst[tokens > 600] = max(worst.get(tokens > 600, 0.0), abs(got - expected))
            assert abs(got - expected) <= (1e-5 if tokens <= 600 else 1e-4), (tokens, got, expected)
    assert min(lengths) >= 500 and max(lengths) >= 16000 and len(lengths) == 6, lengths

    run(ranks_module(1, "ds_packdpo.train", "--output-dir", str(tmp_path / "train"), *flags, *training))
    (step,) = read_metrics(tmp_path / "train" / "metrics.jsonl")
    expected = dpo_loss(fp64_sums(flags, policy), want, beta=0.1)
    assert 1e-3 < expected and step["pairs"] == 3
    print(f"worst |file - fp64| (nats): ~512 tokens {worst[False]:.2e}, ~16k tokens {worst[True]:.2e}; "
          f"step-1 loss {expected:.6f}, relative error {abs(step['loss'] / expected - 1):.2e}")
    assert step["loss"] == pytest.approx(expected, rel=1e-6), (step["loss"], expected)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_reference_file_keeps_every_bit_of_fp64_sums(tmp_path, suffix):
    """Written and read back, a sum that fp32 cannot hold (a 16k-token-sized one) is the same double, in both
    formats; a file of format version 1 (fp32 sums) is refused by its fingerprint."""
    sums = [-113781.98324978621, -3557.1575712499784, -0.1 - 2**-40]
    assert all(float(torch.tensor(s, dtype=torch.float32)) != s for s in sums)
    columns = {"pair_id": [3, 1, 2], "chosen_logps": sums, "rejected_logps": [s / 3 for s in sums],
               "chosen_tokens": [16384, 512, 1], "rejected_tokens": [16000, 500, 2]}
    path = tmp_path / f"ref{suffix}"
    fingerprint = {"format_version": FORMAT_VERSION, "model": "m"}
    write_reference(path, columns, fingerprint, {})
    reference = PrecomputedReference.load(path, fingerprint, [1, 2, 3])
    assert reference.values.dtype == torch.float64
    order = [1, 2, 0]  # pair ids 1, 2, 3
    for column, key in enumerate(RECORD_KEYS[1:]):
        assert reference.values[:, column].tolist() == [float(columns[key][i]) for i in order], key
    write_reference(path, columns, {**fingerprint, "format_version": 1}, {})  # as the fp32 writer labelled its files
    with pytest.raises(InputError, match="computed for a different format_version"):
        PrecomputedReference.load(path, fingerprint, [1, 2, 3])
