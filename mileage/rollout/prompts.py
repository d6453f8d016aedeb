"""A prompt record, and the prompt files it is read from: JSONL (a string or an OpenAI-style
message list per record, with optional tool specs and metadata) and Parquet columns.

Every reader names the file, line and key of the first bad record, as one `UserError` line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mileage.errors import UserError


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the dataset; stable across runs
    text: str  # the prompt text (for a message list: the last user message's content)
    label: str
    # a chat prompt: the record's message list (rendered through the chat template)
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # the record's tool specs (--tool-key)
    metadata: dict[str, Any] | None = None  # the record's metadata (--metadata-key)


def prompt_from_record(
    index: int, record: dict[str, Any], input_key: str, label_key: str, where: str
) -> Prompt:
    """One record's prompt: its input is a string or an OpenAI-style message list; its tools
    and metadata come from the data config's keys when the caller found them."""
    value = record[input_key]
    messages = None
    if isinstance(value, list):
        if not value or not all(isinstance(m, dict) and "role" in m for m in value):
            raise UserError(f"{where}: {input_key!r} must be a string or a list of messages")
        messages = value
        users = [m for m in value if m.get("role") == "user"]
        text = str((users or value)[-1].get("content", ""))
    elif value is None:
        raise UserError(f"{where}: {input_key!r} is null; give the prompt text")
    else:
        text = str(value)
    return Prompt(index, text, label_text(record[label_key], label_key, where), messages)


def has_answers(value: Any) -> bool:
    """Whether a record's input is a message list with assistant turns: a conversation that
    holds its own answers (`mileage sft` trains them), so it needs no label."""
    return isinstance(value, list) and any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in value
    )


def label_text(value: Any, label_key: str, where: str) -> str:
    """A record's reference answer as the scorers get it. A null label is refused: str(None) is
    "None", which no answer matches, so every reward would be 0 without a word. A reward that
    needs no label still gets the key (any value, "" included), as a missing key is refused too."""
    if value is None:
        raise UserError(
            f"{where}: {label_key!r} is null; give the reference answer "
            '("" if the reward function does not read labels)'
        )
    return str(value)


KEY_FLAGS = "--input-key/--label-key"


def decoded(raw: bytes, path: str, lineno: int) -> str:
    """One JSONL line as text; a byte that is not UTF-8 (JSON's encoding) is named by its file,
    line and column, where reading the whole file as text would only raise mid-iteration."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path}:{lineno}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
            "save the file as UTF-8"
        ) from None


def load_jsonl(
    path: str,
    input_key: str,
    label_key: str,
    key_flags: str = KEY_FLAGS,
    tool_key: str | None = None,
    metadata_key: str | None = None,
) -> list[Prompt]:
    """Read prompts from JSONL, naming the file and line of the first bad record."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"prompt file not found: {path}")
    prompts = []
    with file.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            line = decoded(raw, path, lineno)
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # the BOM some Windows editors write
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                # a \ud800-\udfff escape outside a pair reads as a str UTF-8 cannot encode (the
                # tokenizer, preflight's byte count); only a \u escape can give one
                if "\\u" in line:
                    json.dumps(record, ensure_ascii=False).encode("utf-8")
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            except RecursionError:
                raise UserError(f"{path}:{lineno}: JSON nested too deeply to read") from None
            except UnicodeEncodeError:
                raise UserError(
                    f"{path}:{lineno}: a \\u escape of half a surrogate pair, which is no "
                    "character; write the text as UTF-8 or escape both halves"
                ) from None
            except ValueError:  # json's only other one: an integer past Python's digit limit
                raise UserError(
                    f"{path}:{lineno}: a number with too many digits to read; quote it as a string"
                ) from None
            if (
                isinstance(record, dict)
                and label_key not in record
                and has_answers(record.get(input_key))
            ):
                record = {**record, label_key: ""}  # a conversation with its answers (SFT data)
            for key in (input_key, label_key):
                if not isinstance(record, dict) or key not in record:
                    raise UserError(f"{path}:{lineno}: missing key {key!r} (set {key_flags})")
            where = f"{path}:{lineno}"
            prompt = prompt_from_record(len(prompts), record, input_key, label_key, where)
            tools = record.get(tool_key) if tool_key else None
            if tools is not None and not (
                isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
            ):
                raise UserError(f"{where}: {tool_key!r} must be a list of tool dicts")
            metadata = record.get(metadata_key) if metadata_key else None
            if metadata is not None and not isinstance(metadata, dict):
                raise UserError(f"{where}: {metadata_key!r} must be a JSON object")
            prompts.append(replace(prompt, tools=tools, metadata=metadata))
    if not prompts:
        raise UserError(f"prompt file is empty: {path}")
    return prompts


def load_parquet(
    path: str, input_key: str, label_key: str, key_flags: str = KEY_FLAGS
) -> list[Prompt]:
    """Read prompts from the `input_key` and `label_key` columns of a Parquet file."""
    if not Path(path).is_file():
        raise UserError(f"prompt file not found: {path}")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow: pip install 'mileage[parquet]'") from None
    try:
        columns = pq.read_schema(path).names
        missing = [key for key in (input_key, label_key) if key not in columns]
        if missing:
            raise UserError(
                f"{path}: missing column {missing[0]!r} (set {key_flags}); "
                f"columns: {', '.join(columns)}"
            )
        table = pq.read_table(path, columns=[input_key, label_key]).to_pydict()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        reason = " ".join(str(exc).split())  # pyarrow's messages can span lines
        raise UserError(f"{path}: not a readable Parquet file ({reason})") from None
    prompts = []
    for i, (text, label) in enumerate(zip(table[input_key], table[label_key], strict=True)):
        where = f"{path}: row {i}"
        if text is None:
            raise UserError(f"{where}: {input_key!r} is null; give the prompt text")
        prompts.append(Prompt(i, str(text), label_text(label, label_key, where)))
    if not prompts:
        raise UserError(f"prompt file is empty: {path}")
    return prompts
