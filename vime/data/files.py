"""Dataset files: the rows of `data.path` / `eval.path`, read from local files with the `datasets` library.

A path is a file, a directory (every data file directly in it) or a glob of shards; the format comes from the
file names (.jsonl / .json: JSON lines or a JSON list; .parquet). Nothing is downloaded: `datasets` runs with
`HF_DATASETS_OFFLINE=1`. Each row becomes a `Row`: the prompt (a string, or chat messages `{"role",
"content"}`), the label (the reward's ground truth) and every other column as `metadata`.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import tempfile
from pathlib import Path
from typing import Any

from vime.errors import DataError

# file suffix -> the `datasets` builder that reads it
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One dataset row: its index in the file order, the prompt as the file has it, the label, the other columns."""

    index: int
    prompt: str | list[dict[str, str]]
    label: Any
    metadata: dict[str, Any]


def resolve(path: str, key: str = "data.path") -> list[Path]:
    """The data files `path` names (a file, a directory's data files, or a glob), sorted; DataError (naming `key`)
    when there are none or their formats are unknown or mixed."""
    p = Path(path).expanduser()
    if any(c in path for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if not files:
            raise DataError(f"{key}={path}: the glob matches no file; check the pattern (quote it on the command line)")
    elif p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in FORMATS)
        if not files:
            raise DataError(f"{key}={path}: the directory has no {'/'.join(FORMATS)} file; put the dataset there")
    elif p.is_file():
        files = [p]
    else:
        raise DataError(f"{key}={path}: no such file or directory; pass a .jsonl, .json or .parquet file, dir or glob")
    unknown = [f.name for f in files if f.suffix not in FORMATS]
    if unknown:
        raise DataError(
            f"{key}={path}: unknown format of {', '.join(unknown[:3])}; use .jsonl, .json or .parquet files"
        )
    builders = {FORMATS[f.suffix] for f in files}
    if len(builders) > 1:
        raise DataError(f"{key}={path}: mixes JSON and parquet files; keep one format per dataset")
    return files


def load_rows(path: str, prompt_key: str, answer_key: str, key: str = "data.path") -> list[Row]:
    """Every row of the dataset at `path`, in file order. DataError (one line naming `key`) for a missing or
    unreadable file, an empty dataset, or a `prompt_key` / `answer_key` the files lack (naming the keys they
    have)."""
    files = resolve(path, key)
    if all(_is_empty(f) for f in files):  # (`datasets` fails on an empty file instead of giving 0 rows)
        raise DataError(f"{key}={path}: the dataset is empty (0 rows); point it at a file with rows")
    table = _read(files, path, key)
    if table.num_rows == 0:
        raise DataError(f"{key}={path}: the dataset is empty (0 rows); point it at a file with rows")
    columns = list(table.column_names)
    for name, which in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if name not in columns:
            section = key.split(".")[0]
            raise DataError(
                f"{key}={path}: no column {name!r} ({section}.{which}); the file has {columns}: "
                f"set {section}.{which} to one of them"
            )
    rows = []
    for i, record in enumerate(table.to_list()):
        prompt = record.pop(prompt_key)
        label = record.pop(answer_key)
        rows.append(Row(i, _check_prompt(prompt, i, path, key), label, record))
    return rows


def _is_empty(file: Path) -> bool:
    """No rows: a JSON file of whitespace (or `[]`), a parquet file whose metadata counts 0 rows."""
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(file).metadata.num_rows == 0
        except Exception:  # noqa: BLE001 - not readable: `_read` says so
            return False
    with file.open("rb") as fh:
        head = fh.read(64).strip()
    return head in (b"", b"[]")


def _read(files: list[Path], path: str, key: str):
    """The files as one in-memory `datasets.Dataset` (offline; the builder's cache goes to a temporary directory
    that is removed at once, so reading leaves nothing in ~/.cache or next to the data)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors come back as one DataError line
    builder = FORMATS[files[0].suffix]
    try:
        with tempfile.TemporaryDirectory(prefix="vime_datasets_") as cache:
            return datasets.load_dataset(
                builder, data_files=[str(f) for f in files], split="train", keep_in_memory=True, cache_dir=cache
            )
    except Exception as e:  # noqa: BLE001 - `datasets` raises many kinds for a bad file; each is the user's file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"{key}={path}: cannot read it as {builder} ({type(e).__name__}: {first}); check the file's format"
        ) from None


def _check_prompt(prompt: Any, i: int, path: str, key: str) -> str | list[dict[str, str]]:
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    ):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise DataError(
        f"{key}={path}: row {i}'s prompt is {type(prompt).__name__} {str(prompt)[:80]!r}; a prompt is a string or "
        'a list of chat messages {"role": ..., "content": ...}'
    )
