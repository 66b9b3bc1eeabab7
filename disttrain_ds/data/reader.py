"""Raw records from JSONL / parquet files, held in a Hugging Face ``datasets`` Arrow table.

Each row keeps the record's raw bytes, untouched: parsing happens later, record by record, so a
line that is not UTF-8, not JSON or has the wrong field types is counted and skipped instead of
failing the whole load (``load_dataset("json")`` infers one schema and stops at the first bad
line). A UTF-8 byte-order mark starting a line is kept here and dropped when the record is parsed.
The Arrow cache lives under the user cache directory, never inside the repository.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class RawRecord:
    """One record as stored: bytes plus where it came from."""

    raw: bytes
    """The JSON line (or a parquet row dumped to JSON)."""
    file: Path
    """File the record came from (relative image paths resolve against its folder)."""
    line: int
    """1-based line (JSONL) or row (parquet) number, for messages."""


def record_files(path: Path, key: str) -> list[Path]:
    """The record files at ``path``: itself, or the record files directly inside a folder."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in RECORD_SUFFIXES and p.is_file())
        if files:
            return files
        raise FileNotFoundError(f"{key}: no {' / '.join(RECORD_SUFFIXES)} files in {path}")
    raise FileNotFoundError(f"{key}: {path} does not exist")


def _rows(files: list[str], stamps: list[tuple[int, int]]):
    """Generator for ``Dataset.from_generator`` (``stamps`` only key the cache on file changes)."""
    del stamps
    for index, name in enumerate(files):
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            line = 0
            for batch in pq.ParquetFile(name).iter_batches():
                for row in batch.to_pylist():
                    line += 1
                    yield {"raw": json.dumps(row, default=repr).encode(), "file": index, "line": line}
        else:
            with open(name, "rb") as f:
                for line, raw in enumerate(f, start=1):
                    if raw.removeprefix(b"\xef\xbb\xbf").strip():  # a byte-order mark alone is a blank line
                        yield {"raw": raw.rstrip(b"\r\n"), "file": index, "line": line}


class RecordTable:
    """Random access to the raw records of some files, through a cached ``datasets.Dataset``."""

    def __init__(self, files: list[Path], cache_dir: Path):
        import datasets

        self.files = [p.resolve() for p in files]
        names = [str(p) for p in self.files]
        stamps = [(p.stat().st_size, p.stat().st_mtime_ns) for p in self.files]
        features = datasets.Features(
            {"raw": datasets.Value("binary"), "file": datasets.Value("int32"), "line": datasets.Value("int64")}
        )
        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # a bar per load is noise in training logs
        try:
            self._ds = datasets.Dataset.from_generator(
                _rows,
                features=features,
                cache_dir=str(cache_dir / "datasets"),
                gen_kwargs={"files": names, "stamps": stamps},
            )
        finally:
            if bars:
                datasets.enable_progress_bars()

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, index: int) -> RawRecord:
        row = self._ds[int(index)]
        return RawRecord(row["raw"], self.files[row["file"]], row["line"])
