"""Training prompts: reading the JSONL file and encoding each line for the target.

One JSON object per line, either `{"prompt": "raw text"}` (encoded exactly as
`dflash_mlx.stream_generate` encodes a string prompt) or `{"messages": [{"role":
..., "content": ...}, ...]}` (rendered with the tokenizer's chat template and
`add_generation_prompt=True`; trailing assistant turns are dropped, since the
target regenerates the response). Blank lines are skipped. Every problem raises
`DataError` naming the file and the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from ..generation import encode_prompt


class DataError(ValueError):
    """The training data file is missing or holds a bad line."""


@dataclass(frozen=True)
class PromptRecord:
    """One usable line of the data file."""

    line: int  # 1-based line number in the file
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None


def read_prompts(path: str | Path) -> list[PromptRecord]:
    """Parse the JSONL data file; at least one prompt is required."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: training data file not found.")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                records.append(_parse_line(line, number, path))
    if not records:
        raise DataError(f"{path}: no prompts (the file is empty).")
    return records


def _parse_line(line: str, number: int, path: Path) -> PromptRecord:
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg}).") from e
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with 'prompt' or 'messages'.")
    has_prompt, has_messages = "prompt" in row, "messages" in row
    if has_prompt == has_messages:
        raise DataError(f"{where}: expected exactly one of the fields 'prompt' and 'messages'.")
    if has_prompt:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise DataError(f"{where}: 'prompt' must be a non-empty string.")
        return PromptRecord(line=number, prompt=prompt)
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of messages.")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: 'messages[{i}]' must be an object with string fields 'role' and 'content'.")
    kept = list(messages)
    while kept and kept[-1]["role"] == "assistant":
        kept.pop()
    if not kept:
        raise DataError(f"{where}: 'messages' holds only assistant turns; nothing to prompt with.")
    return PromptRecord(line=number, messages=tuple(kept))


def encode_record(
    tokenizer, record: PromptRecord, source: str, chat_template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """Token ids of one prompt; `source` (the file name) is used in errors."""
    where = f"{source}:{record.line}"
    if record.prompt is not None:
        ids = encode_prompt(tokenizer, record.prompt).tolist()
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{where}: a 'messages' line needs a chat template, but the target's tokenizer "
                "has none (use 'prompt' lines with raw text instead)."
            )
        try:
            text = tokenizer.apply_chat_template(
                list(record.messages),
                add_generation_prompt=True,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
        except (TemplateError, ValueError, TypeError, KeyError) as e:  # jinja2's own, or the template's
            raise DataError(f"{where}: the chat template failed on these messages ({e}).") from e
        ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise DataError(f"{where}: the prompt encodes to no tokens.")
    return [int(i) for i in ids]


def encode_prompts(
    tokenizer, records: list[PromptRecord], source: str, chat_template_kwargs: dict[str, Any] | None = None
) -> list[list[int]]:
    return [encode_record(tokenizer, r, source, chat_template_kwargs) for r in records]
