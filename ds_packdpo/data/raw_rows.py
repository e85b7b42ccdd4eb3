"""A dataset's raw rows as a stream of (location, value), read again for each pass: never one Python list of rows.

``prepare`` passes over the rows twice: once to learn the columns (the format is detected from all of them, as
before), once to validate and write the normalized pairs (``data/normalized.py``).  A JSON-lines file is read a
line at a time, Parquet and Arrow files a record batch at a time, a ``save_to_disk`` folder or a hub dataset from
datasets' memory-mapped table: at a million rows the host holds one batch, not a million dicts (8.4 GiB a third of
the way into a 1M-pair prepare when the rows were one list).  A JSON array file (``[...]``) is the exception: JSON
has no streaming parser in the stdlib, so its rows are parsed once and held (large data belongs in JSON lines).

Local .json/.jsonl are parsed with the stdlib: datasets' json builder reports a truncated file, a bad line or mixed
types as a pyarrow error with no row number.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InputError
from .rows import BadRow

FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow")
BATCH_ROWS = 4096  # rows converted to Python at once from a columnar source
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_BINARY = "binary content (NUL bytes), not a JSON text file"


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (pyarrow's span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


@dataclass
class ColumnScan:
    """What the first pass learns of the rows: how many, the union of the objects' keys, each key's first non-null
    value (the format and the group layout are read from these)."""

    rows: int = 0
    objects: int = 0
    columns: set[str] = field(default_factory=set)
    first: dict[str, object] = field(default_factory=dict)

    def add(self, value) -> None:
        self.rows += 1
        if isinstance(value, dict):
            self.objects += 1
            self.columns.update(value)
            for key, item in value.items():
                if item is not None and key not in self.first:
                    self.first[key] = item


@dataclass(frozen=True)
class RawRows:
    """The rows of one dataset, each pass a fresh iterator of (location, value); an unreadable JSON line is a BadRow
    value (its row is counted bad), a file that is not one of its kind raises InputError."""

    label: str
    _passes: Callable[[], Iterator[tuple[str, object]]]

    def __iter__(self) -> Iterator[tuple[str, object]]:
        return self._passes()

    def scan(self) -> ColumnScan:
        scan = ColumnScan()
        for _, value in self:
            scan.add(value)
        return scan


def rows_in_memory(rows: list, label: str) -> RawRows:
    return RawRows(label, lambda: ((f"row {i}", row) for i, row in enumerate(rows)))


def _batched(batches: Callable[[], Iterator], label: str, kind: str) -> RawRows:
    """Rows of a columnar source (each batch has ``to_pylist``), numbered across batches."""
    def rows():
        index = 0
        try:
            for batch in batches():
                for value in batch.to_pylist():
                    yield f"row {index}", value
                    index += 1
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"{label}: not a readable {kind} file ({one_line(exc)})") from None
    return RawRows(label, rows)


def _holds_nul(path: Path) -> bool:
    with open(path, "rb") as handle:
        return any(b"\x00" in block for block in iter(lambda: handle.read(1 << 24), b""))


def _as_text(raw: bytes, label: str, encoding: str, offset: int = 0, whole_file: Path | None = None) -> str:
    """``raw`` (the file, or one line of ``whole_file`` at byte ``offset``) decoded: a NUL byte names the file binary
    (wherever in the whole file its first one lies), another byte that is not UTF-8 is named with its offset."""
    if b"\x00" in raw:
        raise InputError(f"{label}: {_BINARY}")
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        if whole_file is not None and _holds_nul(whole_file):
            raise InputError(f"{label}: {_BINARY}") from None
        raise InputError(f"{label}: not UTF-8 text (binary content?), bad byte at offset "
                         f"{offset + exc.start}") from None


def _json_lines(path: Path, label: str) -> Iterator[tuple[str, object]]:
    """One (location, value) per non-blank line, read a line at a time; NUL bytes or bytes that are not UTF-8 stop
    the read with the file's byte offset, a line that does not parse is that row's BadRow."""
    index, offset = 0, 0
    with open(path, "rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            line = _as_text(raw, label, "utf-8-sig" if line_no == 1 else "utf-8", offset, path)
            offset += len(raw)
            if not line.strip():
                continue
            where = f"row {index} (line {line_no})"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                value = BadRow("unreadable_json_line", f"not valid JSON ({exc.msg}: column {exc.colno})")
            yield where, value
            index += 1
    if index == 0:
        raise InputError(f"{label}: the file is empty")


def _position(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    column = pos - text.rfind("\n", 0, pos)
    return f"line {line} column {column}"


def _read_text(path: Path, label: str) -> str:
    text = _as_text(path.read_bytes(), label, "utf-8-sig")
    if not text.strip():
        raise InputError(f"{label}: the file is empty")
    return text


def _json_array_rows(text: str, start: int, label: str) -> list:
    """Parses the JSON list opening at ``text[start]`` element by element, so an error names the row it is in."""
    decoder = json.JSONDecoder()
    pos = _WHITESPACE.match(text, start + 1).end()
    rows: list = []
    if text.startswith("]", pos):
        return rows
    while True:
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            where = _position(text, exc.pos)
            # as json itself words it: "<msg>: line L column C" (its msg may end in "at": "... starting at")
            message = f"{label} row {len(rows)}: not valid JSON, truncated or malformed ({exc.msg}: {where})"
            raise InputError(message) from None
        rows.append(value)
        pos = _WHITESPACE.match(text, pos).end()
        if pos == len(text):
            raise InputError(f"{label} row {len(rows) - 1}: the JSON list is not closed (truncated file?)")
        if text[pos] == "]":
            break
        if text[pos] != ",":
            where = _position(text, pos)
            raise InputError(f"{label} row {len(rows) - 1}: expected ',' or ']' after the row at {where}")
        pos = _WHITESPACE.match(text, pos + 1).end()
    end = _WHITESPACE.match(text, pos + 1).end()
    if end != len(text):
        raise InputError(f"{label}: unexpected data after the JSON list at {_position(text, end)}")
    return rows


def _opens_a_json_array(path: Path) -> bool:
    """Whether the file's first non-blank character (after a UTF-8 byte-order mark) is ``[``."""
    with open(path, "rb") as handle:
        while block := handle.read(1 << 16):
            text = block.lstrip(b"\xef\xbb\xbf \t\r\n")
            if text:
                return text.startswith(b"[")
    return False


def _json_file(path: Path, label: str) -> RawRows:
    if path.suffix.lower() == ".json" and _opens_a_json_array(path):
        text = _read_text(path, label)
        values = _json_array_rows(text, _WHITESPACE.match(text).end(), label)
        return rows_in_memory(values, label)
    return RawRows(label, lambda: _json_lines(path, label))  # like datasets, a .json file may hold JSON lines


def _arrow_table(path: Path, label: str) -> pa.Table:
    """Arrow IPC stream (what datasets writes) or IPC file, memory-mapped: pyarrow reads it in place, no copy."""
    for open_reader in (pa.ipc.open_stream, pa.ipc.open_file):
        try:
            with pa.memory_map(str(path)) as source:
                return open_reader(source).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            error = exc
    raise InputError(f"{label}: not a readable Arrow file ({one_line(error)})")


def _dataset_rows(dataset: datasets.Dataset, label: str) -> RawRows:
    """Rows of a datasets table (memory-mapped), a batch at a time."""
    return _batched(lambda: dataset.with_format("arrow").iter(batch_size=BATCH_ROWS), label, "dataset")


def open_rows(dataset: str, split: str) -> RawRows:
    """The rows of ``dataset``: a local file (.json/.jsonl/.parquet/.arrow), a ``save_to_disk`` folder, or a hub
    name; a path that is not there, or not of its kind, is one InputError naming it."""
    label = dataset
    path = Path(dataset).expanduser()
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError, OSError, pa.ArrowInvalid) as exc:
            raise InputError(f"{label}: not a folder written by save_to_disk ({one_line(exc)})") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise InputError(f"{label}: no split '{split}'; splits found: {', '.join(loaded)}")
            loaded = loaded[split]
        return _dataset_rows(loaded, label)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".json", ".jsonl"):
            return _json_file(path, label)
        if suffix == ".parquet":
            try:
                parquet = pq.ParquetFile(str(path))
            except (pa.ArrowInvalid, OSError) as exc:
                raise InputError(f"{label}: not a readable Parquet file ({one_line(exc)})") from None
            return _batched(lambda: parquet.iter_batches(batch_size=BATCH_ROWS), label, "Parquet")
        if suffix == ".arrow":
            table = _arrow_table(path, label)
            return _batched(lambda: iter(table.to_batches(max_chunksize=BATCH_ROWS)), label, "Arrow")
        raise InputError(f"{label}: unsupported file type '{suffix}'; expected one of {', '.join(FILE_SUFFIXES)}")
    if path.suffix.lower() in FILE_SUFFIXES or dataset.startswith(("/", ".", "~")):
        raise InputError(f"{label}: no such file or folder")
    try:
        loaded = datasets.load_dataset(dataset, split=split)
    except Exception as exc:  # the hub raises many types (network, auth, missing repo): all are user-facing
        raise InputError(f"{label}: not a local file or folder, and loading it from the hub failed "
                         f"({one_line(exc)})") from None
    return _dataset_rows(loaded, label)
