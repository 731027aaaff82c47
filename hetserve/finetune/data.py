"""SFT datasets in LLaMA-Factory's formats: `dataset_info.json` entries -> conversations.

Who calls it: the trainer, once before training. `load_examples(names, dataset_dir)` reads each
named dataset's file (JSON list or JSON lines) with its `formatting` (alpaca or sharegpt) and
its `columns`/`tags` mappings as LLaMA-Factory defines them, and returns `Example`s whose
messages alternate user-side and assistant-side turns. A row that cannot be read that way is a
`DatasetError` naming the file and the row (1-based); nothing is skipped silently.

Our own code because the formats' edge cases are the point: LLaMA-Factory drops malformed rows
with a warning, while here a bad row stops the run before any training, with its location.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hetserve.errors import InvalidInputError

INFO_FILE = "dataset_info.json"
USER_SIDE = ("user", "observation")
ASSISTANT_SIDE = ("assistant", "function")


class DatasetError(InvalidInputError):
    """A dataset, its dataset_info.json entry or one of its rows is invalid."""


@dataclass
class Example:
    messages: list[dict[str, str]]  # {"role": user|assistant|observation|function, "content"}
    system: str | None = None
    source: str = ""  # "file:row N", for error messages
    tools: str | None = None


@dataclass(frozen=True)
class DatasetAttr:
    name: str
    file: Path
    formatting: str = "alpaca"
    columns: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)


def read_info(dataset_dir: str | Path, name: str) -> DatasetAttr:
    root = Path(dataset_dir)
    info_path = root / INFO_FILE
    if not info_path.is_file():
        raise DatasetError(f"{info_path} not found; set dataset_dir to the folder that has it")
    try:
        info = json.loads(info_path.read_text())
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{info_path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if name not in info:
        import difflib

        close = difflib.get_close_matches(name, list(info), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; it has: {', '.join(info)}"
        raise DatasetError(f"dataset {name!r} is not in {info_path}{hint}")
    entry = info[name]
    if "file_name" not in entry:
        remote = next((k for k in ("hf_hub_url", "ms_hub_url", "om_hub_url") if k in entry), None)
        why = f"'{remote}' needs a download, which is not possible here" if remote else ""
        raise DatasetError(f"{info_path}: dataset {name!r} has no 'file_name' {why}".rstrip())
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise DatasetError(f"{info_path}: dataset {name!r}: formatting must be alpaca or sharegpt")
    path = root / entry["file_name"]
    if not path.is_file():
        raise DatasetError(f"{info_path}: dataset {name!r}: file {str(path)!r} not found")
    return DatasetAttr(name, path, formatting, entry.get("columns", {}), entry.get("tags", {}))


def read_rows(path: Path) -> list[tuple[int, object]]:
    """(row number, row) of a JSON list or a JSON-lines file."""
    text = path.read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        return list(enumerate(rows, start=1))
    out = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((i, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: row {i}: not valid JSON ({exc.msg})") from None
    return out


def _text(row: dict, key: str | None, where: str, required: bool = False) -> str | None:
    if key is None:
        return None
    value = row.get(key)
    if value is None or value == "":
        if required:
            raise DatasetError(f"{where}: missing {key!r}")
        return None
    if not isinstance(value, str):
        raise DatasetError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    return value


def alpaca_example(row: dict, cols: dict, where: str) -> Example:
    prompt = _text(row, cols.get("prompt", "instruction"), where, required=True)
    query = _text(row, cols.get("query", "input"), where)
    response = _text(row, cols.get("response", "output"), where, required=True)
    messages = []
    history = row.get(cols.get("history", "history")) or []
    if not isinstance(history, list) or not all(
        isinstance(h, list | tuple) and len(h) == 2 and all(isinstance(s, str) for s in h)
        for h in history
    ):
        raise DatasetError(f"{where}: 'history' must be a list of [query, response] pairs")
    for q, a in history:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    content = f"{prompt}\n{query}" if query else prompt
    messages += [{"role": "user", "content": content}, {"role": "assistant", "content": response}]
    system = _text(row, cols.get("system", "system"), where)
    return Example(messages, system, where, _text(row, cols.get("tools"), where))


def _sharegpt_tags(turns: list, tags: dict) -> dict:
    """LLaMA-Factory's defaults: from/value/human/gpt, or the OpenAI role/content style when the
    first turn has a 'role' key."""
    openai = bool(turns) and isinstance(turns[0], dict) and "role" in turns[0]
    base = (
        {"role_tag": "role", "content_tag": "content", "user_tag": "user",
         "assistant_tag": "assistant", "system_tag": "system", "observation_tag": "tool",
         "function_tag": "function_call"}
        if openai
        else {"role_tag": "from", "content_tag": "value", "user_tag": "human",
              "assistant_tag": "gpt", "system_tag": "system", "observation_tag": "observation",
              "function_tag": "function_call"}
    )  # fmt: skip
    return {**base, **tags}


def sharegpt_example(row: dict, cols: dict, tags: dict, where: str) -> Example:
    key = cols.get("messages") or ("conversations" if "conversations" in row else "messages")
    turns = row.get(key)
    if not isinstance(turns, list) or not turns:
        raise DatasetError(f"{where}: {key!r} must be a non-empty list of turns")
    t = _sharegpt_tags(turns, tags)
    roles = {
        t["user_tag"]: "user",
        t["assistant_tag"]: "assistant",
        t["observation_tag"]: "observation",
        t["function_tag"]: "function",
    }
    system = _text(row, cols.get("system", "system"), where)
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DatasetError(f"{where}: turn {i + 1} is not an object")
        role, content = turn.get(t["role_tag"]), turn.get(t["content_tag"])
        if not isinstance(content, str):
            raise DatasetError(f"{where}: turn {i + 1} has no string {t['content_tag']!r}")
        if i == 0 and role == t["system_tag"]:
            system = content
            continue
        if role not in roles:
            raise DatasetError(
                f"{where}: turn {i + 1}: unknown role {role!r}; expected one of {sorted(roles)} "
                "(set 'tags' in dataset_info.json)"
            )
        side = USER_SIDE if len(messages) % 2 == 0 else ASSISTANT_SIDE
        if roles[role] not in side:
            raise DatasetError(
                f"{where}: turn {i + 1} is {role!r}, but turns must alternate user and assistant"
            )
        messages.append({"role": roles[role], "content": content})
    if len(messages) % 2:
        raise DatasetError(f"{where}: the conversation must end with an assistant turn")
    return Example(messages, system, where, _text(row, cols.get("tools"), where))


def load_examples(
    names: list[str], dataset_dir: str | Path, max_samples: int | None = None
) -> list[Example]:
    """Every example of the named datasets, in file order (the first `max_samples` of each)."""
    examples: list[Example] = []
    for name in names:
        attr = read_info(dataset_dir, name)
        rows = read_rows(attr.file)
        if max_samples is not None:
            rows = rows[:max_samples]
        for n, row in rows:
            where = f"{attr.file}: row {n}"
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected a JSON object")
            if attr.formatting == "alpaca":
                examples.append(alpaca_example(row, attr.columns, where))
            else:
                examples.append(sharegpt_example(row, attr.columns, attr.tags, where))
    if not examples:
        raise DatasetError(f"datasets {', '.join(names)} have no rows")
    return examples
