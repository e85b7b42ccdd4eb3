"""The embedded default dataset: preference pairs built in memory, no files, no downloads.

Two needs shape it.  Packing and rank balancing are only worth measuring on
lengths that look like real chat data, so prompt and reply word counts are
lognormal (a long right tail, like dpo_en_demo.json).  And a default run must
show that training works, so the preference is one a tiny randomly initialised
model picks up by DPO in ~100 CPU steps: every topic owns a set of "good" reply
words and a disjoint set of "bad" ones; the chosen reply is written in the
prompt topic's good words, the rejected one in its bad words.  That is a
token-level difference (a unigram bias already separates them), and the topic
conditioning gives attention something to learn on top.

Words are pronounceable pseudo-words so the vocabulary is large, fixed and
disjoint by construction; the vocabulary does not depend on ``seed``, only the
sampled pairs do.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np

from .tokenizer import train_bpe_tokenizer

NUM_TOPICS = 8
WORDS_PER_SET = 24
NEUTRAL_WORDS = 32
PROMPT_MEDIAN_WORDS, PROMPT_SIGMA, PROMPT_MAX_WORDS = 40, 0.9, 400
REPLY_MEDIAN_WORDS, REPLY_SIGMA, REPLY_MAX_WORDS = 30, 0.7, 300
MIN_WORDS = 3
MIN_RESPONSES, MAX_RESPONSES, SCORE_LEVELS = 2, 8, 5  # responses per prompt of the multi-response rows; scores 1-5
# Share of prompt words drawn from the topic's good words (the rest are neutral),
# so the prompt names its topic with the very words a chosen reply should use.
PROMPT_TOPIC_SHARE = 0.5
DEFAULT_VOCAB_SIZE = 1024  # ~1.05 tokens per pseudo-word; 768 gives ~1.4

_CONSONANTS = list("bdfgklmnprstvz")
_VOWELS = list("aeiou")


def _pseudo_words(count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` distinct consonant-vowel words of 2-3 syllables."""
    syllables = np.array([c + v for c in _CONSONANTS for v in _VOWELS])
    words: dict[str, None] = {}
    while len(words) < count:
        n_syllables = rng.integers(2, 4)
        words.setdefault("".join(rng.choice(syllables, size=n_syllables)), None)
    return np.array(list(words))


def _vocabulary() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(good [topics, words], bad [topics, words], neutral [words]); fixed, all disjoint."""
    words = _pseudo_words(2 * NUM_TOPICS * WORDS_PER_SET + NEUTRAL_WORDS, np.random.default_rng(20240611))
    topic_words = words[: 2 * NUM_TOPICS * WORDS_PER_SET].reshape(NUM_TOPICS, 2, WORDS_PER_SET)
    return topic_words[:, 0], topic_words[:, 1], words[2 * NUM_TOPICS * WORDS_PER_SET :]


GOOD_WORDS, BAD_WORDS, NEUTRAL = _vocabulary()


def _lognormal_counts(rng: np.random.Generator, n: int, median: int, sigma: float, maximum: int) -> np.ndarray:
    counts = np.rint(rng.lognormal(np.log(median), sigma, size=n)).astype(np.int64)
    return np.clip(counts, MIN_WORDS, maximum)


def _sentences(words: np.ndarray, counts: np.ndarray) -> list[str]:
    """Splits a flat word array into one space-joined text per count."""
    bounds = np.cumsum(counts)[:-1]
    return [" ".join(chunk) for chunk in np.split(words, bounds)]


def _prompt_texts(rng: np.random.Generator, topics: np.ndarray, prompt_counts: np.ndarray) -> list[str]:
    """One prompt per topic: its good words (PROMPT_TOPIC_SHARE of them, and always the first) among neutral ones."""
    prompt_topic = np.repeat(topics, prompt_counts)
    from_topic = rng.random(prompt_topic.size) < PROMPT_TOPIC_SHARE
    from_topic[np.cumsum(prompt_counts) - prompt_counts] = True  # every prompt opens with a topic word
    prompt_words = np.where(
        from_topic,
        GOOD_WORDS[prompt_topic, rng.integers(0, WORDS_PER_SET, size=prompt_topic.size)],
        NEUTRAL[rng.integers(0, NEUTRAL.size, size=prompt_topic.size)],
    )
    return _sentences(prompt_words, prompt_counts)


def synthetic_preference_rows(num_pairs: int = 2048, seed: int | list[int] = 0) -> list[dict]:
    """Conversational rows with an explicit prompt; deterministic for ``(num_pairs, seed)``."""
    rng = np.random.default_rng(seed)
    topics = rng.integers(0, NUM_TOPICS, size=num_pairs)
    prompt_counts = _lognormal_counts(rng, num_pairs, PROMPT_MEDIAN_WORDS, PROMPT_SIGMA, PROMPT_MAX_WORDS)
    chosen_counts = _lognormal_counts(rng, num_pairs, REPLY_MEDIAN_WORDS, REPLY_SIGMA, REPLY_MAX_WORDS)
    rejected_counts = _lognormal_counts(rng, num_pairs, REPLY_MEDIAN_WORDS, REPLY_SIGMA, REPLY_MAX_WORDS)
    prompts = _prompt_texts(rng, topics, prompt_counts)
    chosen_topic = np.repeat(topics, chosen_counts)
    chosen_words = GOOD_WORDS[chosen_topic, rng.integers(0, WORDS_PER_SET, size=chosen_topic.size)]
    rejected_topic = np.repeat(topics, rejected_counts)
    rejected_words = BAD_WORDS[rejected_topic, rng.integers(0, WORDS_PER_SET, size=rejected_topic.size)]

    chosen = _sentences(chosen_words, chosen_counts)
    rejected = _sentences(rejected_words, rejected_counts)
    return [
        {
            "prompt": [{"role": "user", "content": prompt + "?"}],
            "chosen": [{"role": "assistant", "content": good + "."}],
            "rejected": [{"role": "assistant", "content": bad + "."}],
        }
        for prompt, good, bad in zip(prompts, chosen, rejected)
    ]


def write_synthetic_pairs(path, num_pairs: int, seed: int = 0) -> None:
    """``num_pairs`` rows of :func:`synthetic_preference_rows` as JSONL, written block by block (a million pairs never
    sit in memory as one list); deterministic for ``(num_pairs, seed)``: block ``b`` is drawn from seed
    ``(seed, b)``."""
    with open(path, "w") as handle:
        for block, start in enumerate(range(0, num_pairs, _WRITE_BLOCK)):
            rows = synthetic_preference_rows(min(_WRITE_BLOCK, num_pairs - start), seed=[seed, block])
            handle.writelines(json.dumps(row) + "\n" for row in rows)


_WRITE_BLOCK = 10_000


def synthetic_multi_response_rows(num_prompts: int = 256, seed: int = 0, layout: str = "completions",
                                  conversational: bool = True) -> list[dict]:
    """Rows of one prompt and 2-8 scored responses, in a multi-response ``layout`` of data/multi_response.py.

    Lengths are the pairs' lognormal ones (heavy-tailed).  A response's score is its level
    1-5 (ties are common, as in UltraFeedback): a response of level L draws (L - 1) / 4 of
    its words from the prompt topic's good words and the rest from its bad ones.
    ``ranked`` lists the responses best first (a stable sort: ties keep their order).
    Deterministic for the arguments.
    """
    rng = np.random.default_rng(seed)
    topics = rng.integers(0, NUM_TOPICS, size=num_prompts)
    prompts = _prompt_texts(rng, topics, _lognormal_counts(rng, num_prompts, PROMPT_MEDIAN_WORDS, PROMPT_SIGMA,
                                                           PROMPT_MAX_WORDS))
    sizes = rng.integers(MIN_RESPONSES, MAX_RESPONSES + 1, size=num_prompts)
    levels = rng.integers(1, SCORE_LEVELS + 1, size=int(sizes.sum()))
    counts = _lognormal_counts(rng, levels.size, REPLY_MEDIAN_WORDS, REPLY_SIGMA, REPLY_MAX_WORDS)
    word_topic = np.repeat(np.repeat(topics, sizes), counts)
    good = rng.random(word_topic.size) < np.repeat((levels - 1) / (SCORE_LEVELS - 1), counts)
    word = rng.integers(0, WORDS_PER_SET, size=word_topic.size)
    words = np.where(good, GOOD_WORDS[word_topic, word], BAD_WORDS[word_topic, word])
    texts = [text + "." for text in _sentences(words, counts)]
    rows, start = [], 0
    for prompt, size in zip(prompts, sizes.tolist()):
        responses, scores = texts[start:start + size], levels[start:start + size].astype(float).tolist()
        start += size
        row = {"prompt": [{"role": "user", "content": prompt + "?"}] if conversational else prompt + "?"}
        if layout == "completions":
            row["completions"] = [{"response": r, "overall_score": s} for r, s in zip(responses, scores)]
        elif layout == "scored":
            row.update(responses=responses, scores=scores)
        elif layout == "ranked":
            row["responses"] = [responses[j] for j in np.argsort(-np.asarray(scores), kind="stable")]
        else:
            raise ValueError(f"unknown multi-response layout {layout!r}")
        rows.append(row)
    return rows


def synthetic_corpus(rows) -> Iterator[str]:
    """Every message text of the rows, in order: what the local tokenizer is trained on."""
    for row in rows:
        for key in ("prompt", "chosen", "rejected"):
            for message in row[key]:
                yield message["content"]


def default_tokenizer(rows):
    """The local BPE tokenizer for the synthetic rows."""
    return train_bpe_tokenizer(synthetic_corpus(rows), vocab_size=DEFAULT_VOCAB_SIZE)
