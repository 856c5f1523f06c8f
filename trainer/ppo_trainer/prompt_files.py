"""Prompt files, JSONL or Parquet, read into `Prompt`s; a bad record is an error naming where it is.

A record's prompt field (data.promptKey) holds a string or a chat conversation, a list of
``{role, content}`` messages; its label field (data.labelKey) a string, a number (read as its text)
or null. JSONL has one JSON object per line (blank lines are not records); Parquet one row per
record, its fields the columns of those names, read with pyarrow (imported for .parquet files only).
No record is ever skipped: a file yields one prompt per record, or a ValueError naming the file, the
line (JSONL, from 1) or row (Parquet, from 0), and the field; every problem with a file's content is
a ValueError (even a wrong type), so callers catch one exception for "bad data file". Depends on
`data.py` and pyarrow only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

from ppo_trainer.data import CHAT_ROLES, ChatMessage, Prompt

__all__ = ["load_prompt_file"]

Located = Callable[[str], str]
"""A record's location, given a field's name: e.g. ``"a.jsonl:3: key 'prompt'"``."""


def load_prompt_file(
    path: str | Path, *, prompt_key: str = "prompt", label_key: str = "label", require_labels: bool = False
) -> list[Prompt]:
    """Every record of the JSONL or Parquet (``.parquet``) file at ``path``, in file order.

    ``require_labels``: a record without a label (missing or null) is an error, for rewards that
    score against one. Raises FileNotFoundError for a missing file and ValueError (naming the
    file, the line or row, and the field) for a malformed record or a file without records.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    read = _parquet_records if path.suffix == ".parquet" else _jsonl_records
    prompts = []
    for at, prompt, label in read(path, prompt_key=prompt_key, label_key=label_key):
        label = _read_label(label, at(label_key))
        if label is None and require_labels:
            raise ValueError(
                f"{at(label_key)}: no label, and the reward scores against one: give every record a label, "
                f"or set data.labelKey to the field that holds it"
            )
        prompts.append(_read_prompt(prompt, at(prompt_key), label))
    if not prompts:
        raise ValueError(f"{path}: no prompts (the file has no records)")
    return prompts


def _jsonl_records(path: Path, *, prompt_key: str, label_key: str) -> Iterator[tuple[Located, Any, Any]]:
    with path.open("rb") as f:  # bytes, so that text that is not UTF-8 is named by its line
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: not UTF-8 (byte {exc.start + 1} of the line); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")  # noqa: TRY004
            if prompt_key not in record:
                raise ValueError(
                    f"{where}: missing key {prompt_key!r} (keys: {sorted(record)}); set data.promptKey to the "
                    f"field that holds the prompt"
                )
            yield (lambda key, where=where: f"{where}: key {key!r}"), record[prompt_key], record.get(label_key)


def _parquet_records(path: Path, *, prompt_key: str, label_key: str) -> Iterator[tuple[Located, Any, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable Parquet file ({exc})") from None
    names = parquet.schema_arrow.names
    if prompt_key not in names:
        raise ValueError(
            f"{path}: no column {prompt_key!r} (columns: {names}); set data.promptKey to the column that "
            f"holds the prompt"
        )
    columns = [prompt_key, *([label_key] if label_key in names else [])]
    row = 0
    for batch in parquet.iter_batches(columns=columns):
        prompts = batch.column(prompt_key).to_pylist()
        labels = batch.column(label_key).to_pylist() if label_key in columns else [None] * len(prompts)
        for prompt, label in zip(prompts, labels, strict=True):
            yield (lambda column, row=row: f"{path}: row {row}, column {column!r}"), prompt, label
            row += 1


def _read_label(value: Any, at: str) -> str | None:
    """A label as text: a string, a finite number's text (``72`` -> ``"72"``), or None for null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float, Decimal)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{at}: {value} is not a label; give a string, a finite number or null")
        return str(value)
    raise ValueError(f"{at}: must be a string or a number, got {type(value).__name__}")


def _read_prompt(value: Any, at: str, label: str | None) -> Prompt:
    if isinstance(value, str):
        return Prompt(text=value, label=label)
    if isinstance(value, list):
        return Prompt.chat(_read_messages(value, at), label=label)
    if value is None:
        raise ValueError(f"{at}: is null; every record needs a prompt (fill it in or remove the record)")
    raise ValueError(
        f"{at}: must be a string or a list of {{role, content}} messages, got {type(value).__name__}"
    )


def _read_messages(items: list[Any], at: str) -> list[ChatMessage]:
    """A conversation the policy answers: system first if at all, the user's message last."""
    if not items:
        raise ValueError(f"{at}: is an empty list of messages; give at least the user's message")
    messages = []
    for index, item in enumerate(items):
        where = f"{at}: message {index}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: must be an object with role and content, got {type(item).__name__}")  # noqa: TRY004
        missing = [key for key in ("role", "content") if key not in item]
        if missing:
            raise ValueError(f"{where}: has no {' or '.join(missing)} (keys: {sorted(item)}); each message "
                             f"needs a role and a content")
        extra = sorted(key for key, value in item.items() if key not in ("role", "content") and value is not None)
        if extra:
            raise ValueError(f"{where}: has keys besides role and content ({extra}); remove them")
        role, content = item["role"], item["content"]
        if role not in CHAT_ROLES:
            raise ValueError(f"{where}: role {role!r} is not one of {', '.join(CHAT_ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: content must be a string, got {type(content).__name__}")  # noqa: TRY004
        if role == "system" and index > 0:
            raise ValueError(f"{where}: a system message may only come first")
        messages.append(ChatMessage(role=role, content=content))
    if messages[-1].role != "user":
        raise ValueError(
            f"{at}: the last message ({len(messages) - 1}) is the {messages[-1].role}'s; end with the user's "
            f"message, which the policy answers"
        )
    return messages
