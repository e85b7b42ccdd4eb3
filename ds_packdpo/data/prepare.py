"""The data stage: preference rows in, tokenized and truncated pairs (+ lengths) out.

Stages, in this order, so that bad input stops before any heavy work:

1. **load** the raw rows (local file, ``save_to_disk`` folder, hub name, or rows
   in memory);
2. **detect** the format from the columns (or take the forced one) and
   **validate + normalize** every row in plain Python (``data/formats.py``): a bad
   row raises an InputError naming the file, the row and the reason (or is skipped
   and counted with ``on_bad_row="skip"``);
3. **tokenize + truncate** with ``datasets.map``, cached on disk under a
   fingerprint of (normalized content, tokenizer, settings).  A local file or
   folder is also keyed by a hash of its bytes (plus settings and tokenizer), so
   the second call with the same inputs (another rank of the node, a restarted
   run) hashes the file and opens the cache, with no row parsed in Python.

Pure functions over rows and ids: no torch.distributed, no DeepSpeed.  The
trainer makes local rank 0 call first and the others after a barrier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from ..console import say_warning
from ..errors import InputError
from ..files import atomic_write
from .formats import FORMATS, validate_rows
from .multi_response import PAIRS_FROM
from .normalized import NormalizedPairs
from .pair_keys import cached_pair_groups, selected_groups
from .pair_numbers import SIDES, STAT_COLUMNS, cached_pair_numbers
from .prompt_groups import PairGroups
from .raw_rows import open_rows, rows_in_memory

ON_BAD_ROW = ("error", "skip")
MOST = 0.5  # truncation of more than this fraction of the prompts or the completions is said on stderr
# Part of every fingerprint: bump it when tokenization or truncation rules change,
# so caches and precomputed reference log-probs of the old rules are not reused.
DATA_VERSION = 1
DEFAULT_CACHE_DIR = "~/.cache/ds_packdpo"
PAIR_COLUMNS = ("pair_id", "prompt_ids", "chosen_ids", "rejected_ids")


@dataclass(frozen=True)
class DataConfig:
    dataset: str                    # path (.json/.jsonl/.parquet/.arrow, save_to_disk folder) or hub name
    split: str = "train"
    format: str = "auto"
    prompt_column: str = "prompt"
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    conversations_column: str = "conversations"
    max_length: int = 1024
    max_prompt_length: int | None = None
    on_bad_row: str = "error"       # "error" | "skip"
    tokenize_procs: int = 0  # datasets.map's num_proc; 0: tokenize_processes() picks it
    cache_dir: str | None = None
    max_pairs: int | None = None    # keep only the first N valid pairs (handy for tests/bench)
    pairs_from: str = "best-vs-worst"  # pairs of a row with several responses (multi_response.PAIRS_FROM)
    progress: bool = True           # the tokenization's progress bar (--no-progress: none)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise InputError(f"format '{self.format}' is not one of {', '.join(FORMATS)}")
        if self.pairs_from not in PAIRS_FROM:
            raise InputError(f"pairs_from '{self.pairs_from}' is not one of {', '.join(PAIRS_FROM)}")
        if self.on_bad_row not in ON_BAD_ROW:
            raise InputError(f"on_bad_row '{self.on_bad_row}' is not one of {', '.join(ON_BAD_ROW)}")
        for key in ("max_length", "max_prompt_length", "max_pairs"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise InputError(f"{key} must be >= 1, got {value}")
        if self.tokenize_procs < 0:
            raise InputError(f"tokenize_procs must be >= 0, got {self.tokenize_procs}")
        if self.max_prompt_length is not None and self.max_prompt_length >= self.max_length:
            raise InputError(f"--max-prompt-length ({self.max_prompt_length}) must be below --max-length "
                             f"({self.max_length})")

    @property
    def cache_path(self) -> Path:
        """The cache folder (``cache_dir``, or the default under the home folder), user-expanded."""
        return Path(self.cache_dir or DEFAULT_CACHE_DIR).expanduser()

    def cache_file(self, fingerprint: str) -> Path:
        """The tokenized pairs of ``fingerprint`` in the cache (what a run with these data settings reads)."""
        return self.cache_path / f"pairs-{fingerprint}.arrow"

    def cache_files(self, fingerprint: str) -> list[Path]:
        """The cache's files of ``fingerprint``: the one file, or the shards a tokenization with --tokenize-procs N wrote
        (``pairs-F_00000_of_0000N.arrow``, ...; datasets names them so), or none when incomplete."""
        if self.cache_file(fingerprint).is_file():
            return [self.cache_file(fingerprint)]
        shards = sorted(self.cache_path.glob(f"pairs-{fingerprint}_*_of_*.arrow"))
        return shards if shards and len(shards) == int(shards[0].stem.rsplit("_of_", 1)[1]) else []


@dataclass
class PreparedPairs:
    dataset: datasets.Dataset       # pair_id, prompt_ids, chosen_ids, rejected_ids (completion ids after truncation)
    chosen_lengths: np.ndarray      # int64 [N]: len(prompt_ids) + len(chosen_ids)
    rejected_lengths: np.ndarray    # int64 [N]: len(prompt_ids) + len(rejected_ids)
    # JSON-able: dataset, format, rows (raw), kept, dropped {reason: n} (bad rows in skip mode and pairs
    # dropped by truncation), beyond_max_pairs, identical_chosen_rejected, prompt_truncated and
    # completion_truncated (kept pairs), template_prefix_mismatch (sequences), tokens {length statistics},
    # multi_response {groups, responses_per_group, pairs_made, ties_dropped...} for rows with several responses
    summary: dict
    fingerprint: str                # (content, tokenizer, settings); keys caches and precomputed reference log-probs
    prompt_lengths: np.ndarray      # int64 [N]: len(prompt_ids) (what prefix sharing computes once per pair)
    groups: PairGroups              # which pairs share a prompt, and which responses (data/pair_keys.py)
    pair_ids: np.ndarray            # int64 [N]: each pair's id (data/pair_numbers.py)


# ----------------------------------------------------------------------------- tokenization
def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides the ids: vocab, merges, normalizer, post-processor, chat template, special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("truncation", None)  # transient per-call settings, not part of the tokenizer
        state.pop("padding", None)
    else:
        state = sorted(tokenizer.get_vocab().items())
    payload = {
        "class": type(tokenizer).__name__,
        "backend": state,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special_tokens": tokenizer.special_tokens_map,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def _chat_completion_ids(tokenizer, batch: dict, key: str, prompt_ids: list, label: str) -> tuple[list, list]:
    """Completion ids = (prompt + completion rendered) minus the rendered prompt, and per row whether that failed.

    When the prompt ids are not a prefix of the full ids (a template or a BPE merge
    across the boundary), the completion's text suffix is tokenized on its own.
    """
    prompts, completions = batch["prompt"], batch[key]
    full_ids = tokenizer.apply_chat_template([p + c for p, c in zip(prompts, completions)], return_dict=False)
    completion_ids, mismatched = [], []
    for prompt, completion, p_ids, f_ids, pair_id in zip(prompts, completions, prompt_ids, full_ids, batch["pair_id"]):
        mismatched.append(f_ids[: len(p_ids)] != p_ids)
        if not mismatched[-1]:
            completion_ids.append(f_ids[len(p_ids):])
            continue
        prompt_text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        full_text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        if not full_text.startswith(prompt_text):
            raise InputError(
                f"{label} row {pair_id}: the tokenizer's chat template does not render the prompt (with generation "
                "prompt) as a prefix of prompt + completion, so the completion cannot be split off"
            )
        completion_ids.append(tokenizer(full_text[len(prompt_text):], add_special_tokens=False)["input_ids"])
    return completion_ids, mismatched


PAIRS_PER_TOKENIZE_PROC = 50_000  # below this, a worker process costs more to start than it saves
MOST_TOKENIZE_PROCS = 8


def tokenize_processes(asked: int, pairs: int) -> int | None:
    """datasets.map's num_proc: ``asked``, or for 0 one process per PAIRS_PER_TOKENIZE_PROC pairs up to the cores this
    process may use (at most MOST_TOKENIZE_PROCS), and one inside a rank (a rank preparing data under a hand-started
    launcher has its collectives' threads running: no fork there).  None for one: num_proc=1 would still spawn a worker
    process in datasets; None runs in this one."""
    if asked == 0:
        asked = 1 if "LOCAL_RANK" in os.environ else min(len(os.sched_getaffinity(0)), MOST_TOKENIZE_PROCS,
                                                          -(-pairs // PAIRS_PER_TOKENIZE_PROC))
    return asked if asked > 1 else None


def truncation_lengths(prompt_len, chosen_len, rejected_len, max_length: int, max_prompt_length: int | None):
    """Kept lengths (prompt, chosen, rejected) for arrays of raw lengths; vectorized over pairs.

    The prompt keeps its end, completions keep their start.  ``max_prompt_length``
    caps the prompt.  If prompt + longest completion still exceeds ``max_length``,
    the prompt gives way first: it is cut from the left until the longest
    completion fits, but keeps at least one token (the first completion token is
    predicted from the token before it).  Completions are then cut from the right
    to the room left; a pair with no room for one completion token is dropped.
    """
    prompt_len, chosen_len, rejected_len = (np.asarray(n, np.int64) for n in (prompt_len, chosen_len, rejected_len))
    prompt = prompt_len if max_prompt_length is None else np.minimum(prompt_len, max_prompt_length)
    longest = np.maximum(chosen_len, rejected_len)
    prompt = np.minimum(prompt, np.maximum(max_length - longest, np.minimum(prompt, 1)))
    room = max_length - prompt
    return prompt, np.minimum(chosen_len, room), np.minimum(rejected_len, room)


def _encode_batch(batch, tokenizer, conversational: bool, max_length: int, max_prompt_length, label: str, bos: list):
    """datasets.map function: ids of prompt/chosen/rejected after truncation, plus per-pair stat columns."""
    pair_ids, prompts = batch["pair_id"], batch["prompt"]
    if conversational:
        prompt_ids = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, return_dict=False)
        chosen_ids, chosen_mismatch = _chat_completion_ids(tokenizer, batch, "chosen", prompt_ids, label)
        rejected_ids, rejected_mismatch = _chat_completion_ids(tokenizer, batch, "rejected", prompt_ids, label)
        mismatches = (np.array(chosen_mismatch, dtype=np.int64) + np.array(rejected_mismatch, dtype=np.int64)).tolist()
    else:
        eos = [tokenizer.eos_token_id]
        prompt_ids = [bos + ids for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
        chosen_ids = [ids + eos for ids in tokenizer(batch["chosen"], add_special_tokens=False)["input_ids"]]
        rejected_ids = [ids + eos for ids in tokenizer(batch["rejected"], add_special_tokens=False)["input_ids"]]
        mismatches = [0] * len(pair_ids)
    raw = [np.array([len(x) for x in ids]) for ids in (prompt_ids, chosen_ids, rejected_ids)]
    keep_prompt, keep_chosen, keep_rejected = truncation_lengths(*raw, max_length, max_prompt_length)
    no_room = np.where(np.minimum(keep_chosen, keep_rejected) < 1, "no_room_for_completion", "")
    drop = np.where(np.minimum(raw[1], raw[2]) == 0, "empty_completion", no_room)
    return {
        "pair_id": pair_ids,
        "prompt_ids": [ids[len(ids) - k:] for ids, k in zip(prompt_ids, keep_prompt.tolist())],
        "chosen_ids": [ids[:k] for ids, k in zip(chosen_ids, keep_chosen.tolist())],
        "rejected_ids": [ids[:k] for ids, k in zip(rejected_ids, keep_rejected.tolist())],
        "prompt_cut": (keep_prompt < raw[0]).tolist(),
        "completion_cut": ((keep_chosen < raw[1]) | (keep_rejected < raw[2])).tolist(),
        "template_mismatches": mismatches,
        "drop_reason": drop.tolist(),
    }


def _length_stats(lengths: np.ndarray) -> dict:
    return {
        "mean": round(float(lengths.mean()), 2),
        "p50": int(np.percentile(lengths, 50)),
        "p90": int(np.percentile(lengths, 90)),
        "max": int(lengths.max()),
        "total": int(lengths.sum()),
    }


# Settings that change nothing in the tokenized pairs: a cache filled with one value serves the others.
_NOT_IN_CACHE_KEY = ("tokenize_procs", "cache_dir", "progress")


def _source_key(cfg: DataConfig, tokenizer) -> tuple[str, dict] | None:
    """Key of a local dataset as it is on disk (its files' bytes) with every setting and the tokenizer, and those
    parts (the index keeps them, to say why a later run misses it), or None (rows in memory or from the hub).
    Hashing bytes is far cheaper than parsing and validating rows in Python."""
    path = Path(cfg.dataset).expanduser()
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path] if path.is_file() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    settings = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _NOT_IN_CACHE_KEY}
    key = {"version": DATA_VERSION, "files": digest.hexdigest(), "settings": settings,
           "tokenizer": tokenizer_fingerprint(tokenizer)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32], key


def why_tokenized_afresh(cache_dir: Path, key: dict) -> str:
    """Why a local dataset is tokenized again: no cache of its bytes in ``cache_dir``, or the settings (flags) and
    tokenizer that differ from the nearest cache of them (e.g. ``prepare`` run with other settings than ``train``)."""
    nearest = None
    for index in cache_dir.glob("source-*.json"):
        try:
            seen = json.loads(index.read_text())
        except (OSError, ValueError):
            continue
        if seen.get("key", {}).get("files") != key["files"] or seen["key"].get("version") != key["version"]:
            continue
        there = seen["key"]["settings"]
        differ = [f"--{name.replace('_', '-')} {there.get(name)} there, {value} here"
                  for name, value in key["settings"].items() if there.get(name) != value]
        differ += ["another tokenizer"] if seen["key"].get("tokenizer") != key["tokenizer"] else []
        if nearest is None or len(differ) < len(nearest):
            nearest = differ
    if nearest is None:
        return f"no cache of this file in {cache_dir} yet"
    return f"its cache in {cache_dir} has other settings ({'; '.join(nearest)})"


def remove_abandoned_normalizing(cache_dir: Path) -> None:
    """Removes the temporary normalized pairs of a ``prepare`` of this host that died without its cleanup (SIGKILL,
    out of memory): named with host and process id, a file whose process is gone is abandoned.  Another host's files
    in a shared cache folder are left to that host."""
    for path in cache_dir.glob(f"normalizing-{socket.gethostname()}-*-*.arrow"):
        pid = path.name[len(f"normalizing-{socket.gethostname()}-"):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


def prepare_pairs(cfg: DataConfig, tokenizer, rows: list[dict] | None = None) -> PreparedPairs:
    """Loads, validates, tokenizes and truncates ``cfg.dataset``, or the in-memory ``rows`` labelled so.

    A local dataset seen before with the same settings and tokenizer is not read row by row again: its
    bytes' hash leads to the tokenized cache and the validation summary of the first call (so the other
    ranks of a node, after the first, only hash the file and open the cache).
    """
    cache_dir = cfg.cache_path
    cache_dir.mkdir(parents=True, exist_ok=True)
    source, source_parts = (_source_key(cfg, tokenizer) if rows is None else None) or (None, None)
    index = cache_dir / f"source-{source}.json" if source else None
    if index is not None and index.is_file():
        seen = json.loads(index.read_text())
        cached = cfg.cache_files(seen["fingerprint"])
        if cached:  # memory-mapped, the shards of a --tokenize-procs tokenization one table again
            return _finish(cfg, datasets.concatenate_datasets([datasets.Dataset.from_file(str(f)) for f in cached]),
                           seen["fingerprint"], seen["fmt"],
                           seen["rows"], Counter(seen["bad"]), seen["beyond_max_pairs"], seen["quality"],
                           seen.get("multi_response"))
    if index is not None:  # a local file read row by row again: said, with why (once per job: the ranks read this)
        print(f"tokenizing {cfg.dataset}: {why_tokenized_afresh(cache_dir, source_parts)}", file=sys.stderr,
              flush=True)
    label = cfg.dataset
    source = rows_in_memory(rows, label) if rows is not None else open_rows(cfg.dataset, cfg.split)
    remove_abandoned_normalizing(cache_dir)
    handle, normalized_file = tempfile.mkstemp(prefix=f"normalizing-{socket.gethostname()}-{os.getpid()}-",
                                               suffix=".arrow", dir=cache_dir)
    os.close(handle)
    out = NormalizedPairs(Path(normalized_file), cfg.max_pairs)
    try:
        try:
            fmt, row_count, bad, groups = validate_rows(source, cfg, out)
        except BaseException:
            out.discard()
            raise
        normalized = out.close()
        if not out.conversational and tokenizer.eos_token_id is None:
            raise InputError(f"{label}: standard-format completions end with EOS, but the tokenizer has no eos_token")
        if out.conversational and not getattr(tokenizer, "chat_template", None):
            raise InputError(f"{label}: {fmt} data needs a tokenizer with a chat template, and this one has none")
        key = {
            "version": DATA_VERSION,
            "content": out.content_hash(),
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "format": fmt,
            "max_length": cfg.max_length,
            "max_prompt_length": cfg.max_prompt_length,
        }
        fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        with progress_bars(cfg.progress):
            encoded = normalized.map(
                _encode_batch,
                batched=True,
                num_proc=tokenize_processes(cfg.tokenize_procs, out.kept),
                fn_kwargs=dict(
                    tokenizer=tokenizer,
                    conversational=out.conversational,
                    max_length=cfg.max_length,
                    max_prompt_length=cfg.max_prompt_length,
                    label=label,
                    bos=[tokenizer.bos_token_id] if _adds_bos(tokenizer) else [],
                ),
                remove_columns=["prompt", "chosen", "rejected"],
                cache_file_name=str(cfg.cache_file(fingerprint)),
                new_fingerprint=fingerprint,  # explicit: datasets would otherwise hash the tokenizer with dill
                desc="tokenize pairs",
            )
    finally:
        Path(normalized_file).unlink(missing_ok=True)  # the tokenized pairs are in the cache now
    quality, beyond_max_pairs = out.quality(), out.beyond_max_pairs
    prepared = _finish(cfg, encoded, fingerprint, fmt, row_count, bad, beyond_max_pairs, quality, groups)
    if index is not None:  # written once the pairs are: a reader never finds an index without its cache
        atomic_write(index, lambda temporary: Path(temporary).write_text(json.dumps(
            {"fingerprint": fingerprint, "fmt": fmt, "rows": row_count, "bad": dict(bad),
             "beyond_max_pairs": beyond_max_pairs, "quality": quality, "multi_response": groups,
             "key": source_parts})))
    return prepared


@contextlib.contextmanager
def progress_bars(shown: bool):
    """datasets' progress bars on or off for a block (datasets has one switch per process, no per-call one)."""
    was_shown = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if shown else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if was_shown else datasets.disable_progress_bars)()


_QUALITY_WARNINGS = {
    "identical_chosen_rejected": "pairs have identical chosen and rejected completions; kept, but they teach nothing",
    "duplicate_pairs": "pairs repeat an earlier pair exactly (prompt, chosen and rejected); kept, so those pairs "
                       "weigh double",
    "prompt_ends_with_assistant": "prompts end with an assistant turn, so the completion answers the assistant, not "
                                  "the user (a prompt/completion split in the wrong place?)",
}


def _finish(cfg: DataConfig, encoded: datasets.Dataset, fingerprint: str, fmt: str, rows: int, bad: Counter,
            beyond_max_pairs: int, quality: dict[str, int], groups: dict | None) -> PreparedPairs:
    """Lengths, drops and the summary, from the tokenized table (fresh or from the cache)."""
    label = cfg.dataset
    for key, count in quality.items():
        if count:
            say_warning(f"{label}: {count} {_QUALITY_WARNINGS[key]}")
    numbers = cached_pair_numbers(encoded.data.table, cfg.cache_path / f"pairs-{fingerprint}.numbers.npz")
    lengths = {side: numbers[f"{side}_length"] for side in SIDES}
    if bad:  # --on-bad-row skip: said, not only counted in the summary
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(bad.items()))
        say_warning(f"{label}: skipped {sum(bad.values())} of {rows} rows (--on-bad-row skip): {reasons}")
    names, codes = numbers["drop_names"].tolist(), numbers["drop_code"]  # codes, not a fixed-width string a pair
    kept = np.flatnonzero(codes == names.index("")) if "" in names else np.zeros(0, dtype=np.int64)
    counts = np.bincount(codes, minlength=len(names))
    dropped = bad + Counter({name: int(count) for name, count in zip(names, counts) if name and count})
    if kept.size == 0:
        raise InputError(f"{label}: no pair left after truncation to max_length={cfg.max_length} ({dict(dropped)})")
    pairs = encoded.remove_columns(list(STAT_COLUMNS))
    every_pair = kept.size == len(pairs)  # then no array is copied to select the kept pairs (8 MB each at 1M pairs)
    if not every_pair:
        pairs = pairs.select(kept)
    longest = max(int(values.max(initial=0)) for values in lengths.values())  # of every row the keys cover
    lengths = {name: values if every_pair else values[kept] for name, values in lengths.items()}
    chosen_lengths = lengths["prompt"] + lengths["chosen"]
    rejected_lengths = lengths["prompt"] + lengths["rejected"]
    summary = {
        "dataset": label,
        "format": fmt,
        "rows": rows,
        "kept": int(kept.size),
        "dropped": dict(sorted(dropped.items())),
        "beyond_max_pairs": beyond_max_pairs,
        **quality,
        "prompt_truncated": int(numbers["prompt_cut"][kept].sum()),
        "completion_truncated": int(numbers["completion_cut"][kept].sum()),
        "template_prefix_mismatch": int(numbers["template_mismatches"].sum()),
        "tokens": {
            "prompt": _length_stats(lengths["prompt"]),
            "chosen_sequence": _length_stats(chosen_lengths),
            "rejected_sequence": _length_stats(rejected_lengths),
            "total": int(chosen_lengths.sum() + rejected_lengths.sum()),
        },
    }
    if groups is not None:
        summary["multi_response"] = groups
    warn_if_mostly_truncated(cfg, summary)
    groups = cached_pair_groups(encoded, longest, cfg.cache_path / f"pairs-{fingerprint}.groups.npy")
    return PreparedPairs(pairs, chosen_lengths, rejected_lengths, summary, fingerprint, lengths["prompt"],
                         groups if every_pair else selected_groups(groups, kept),
                         numbers["pair_id"] if every_pair else numbers["pair_id"][kept])


def warn_if_mostly_truncated(cfg: DataConfig, summary: dict) -> None:
    """Truncation of most prompts or most completions (``--max-length 4`` cut every prompt to one token) is said on
    stderr with its counts: it changes what trains, and a run that exits 0 hides it in data_summary.json."""
    kept, prompts, completions = summary["kept"], summary["prompt_truncated"], summary["completion_truncated"]
    if max(prompts, completions) <= MOST * kept:
        return
    limits = f"--max-length {cfg.max_length}" + (f", --max-prompt-length {cfg.max_prompt_length}"
                                                  if cfg.max_prompt_length else "")
    dropped = summary["dropped"].get("no_room_for_completion", 0)
    lost = f"; {dropped} pairs dropped with no room left for a completion" if dropped else ""
    say_warning(f"{summary['dataset']}: truncation ({limits}) cut {prompts} of {kept} prompts and {completions} of "
                f"{kept} pairs' completions{lost}")


# ----------------------------------------------------------------------------- outputs
def write_pairs_jsonl(prepared: PreparedPairs, path) -> None:
    """One JSON line per pair, written to a temporary file in the same folder and renamed: never half written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(temporary: str) -> None:
        with open(temporary, "w") as handle:
            for batch in prepared.dataset.iter(batch_size=1024):
                for values in zip(*(batch[name] for name in PAIR_COLUMNS)):
                    handle.write(json.dumps(dict(zip(PAIR_COLUMNS, values))) + "\n")

    atomic_write(path, write)


def run_prepare(cfg: DataConfig, tokenizer, out_path, rows: list[dict] | None = None) -> dict:
    """Body of the ``prepare`` command: tokenized pairs to ``out_path`` (JSON lines); returns the summary to print."""
    prepared = prepare_pairs(cfg, tokenizer, rows)
    write_pairs_jsonl(prepared, out_path)
    return {**prepared.summary, "fingerprint": prepared.fingerprint,
            "cache": [str(f) for f in cfg.cache_files(prepared.fingerprint)], "output": str(out_path)}
