"""The user's own SFT data, read from local files with ``datasets`` and checked before training.

A data source is a file (``.jsonl`` / ``.json``, ``.parquet``, ``.csv``) or a directory that
``datasets.load_dataset`` reads (its files, offline). Rows are TRL's prompt/completion form,
``{"prompt": str, "completion": str}``, or conversational, ``{"messages": [{"role": ...,
"content": ...}, ...]}`` ending with the assistant's answer, which becomes TRL's conversational
prompt/completion (``prompt`` = the messages before it, ``completion`` = ``[answer]``).

Held-out rows are the source's ``validation`` or ``test`` split where it has one, else
``eval_examples`` rows split off the training rows with a fixed seed. Every problem is one
:class:`DataError` naming it, raised before any training: a missing file, missing columns, an
empty split, a row that is neither form or both, or mixes forms with other rows, an empty or
missing completion (an empty CSV cell), a row longer than the model's context; a row's error
names the file and the row (and the line of a JSONL file).

>>> from preft.user_data import to_prompt_completion
>>> to_prompt_completion({"messages": [{"role": "user", "content": "hi"},
...                                    {"role": "assistant", "content": "hello"}]})["completion"]
[{'role': 'assistant', 'content': 'hello'}]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HELD_OUT_SPLITS = ("validation", "test")


class DataError(ValueError):
    """The user's data cannot be trained on (the message says why)."""


def to_prompt_completion(row: dict[str, Any]) -> dict[str, Any]:
    """A conversational ``messages`` row as TRL's conversational prompt/completion."""
    messages = row.get("messages")
    if not isinstance(messages, list) or len(messages) < 2 or not all(isinstance(m, dict) for m in messages):
        raise DataError("a 'messages' row must be a list of at least two {role, content} messages")
    if messages[-1].get("role") != "assistant":
        raise DataError("a 'messages' row must end with the assistant's message (the completion)")
    return {"prompt": messages[:-1], "completion": [messages[-1]]}


def _load(path: Path):
    import datasets

    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # a local file loads in a blink; an error stays one line
    try:
        return _load_quietly(path)
    finally:
        if not quiet:
            datasets.enable_progress_bars()


def _load_quietly(path: Path):
    from datasets import load_dataset

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local source: never the hub
    if not path.exists():
        raise DataError(f"data not found: {path}")
    if path.is_file() and path.stat().st_size == 0:
        raise DataError(f"{path} is empty")
    try:
        if path.is_dir():
            return load_dataset(str(path))
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(f"{path}: unknown data file type {path.suffix!r} (use {', '.join(BUILDERS)})")
        return load_dataset(builder, data_files=str(path))
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds; one line says which file
        detail = (str(err).splitlines() or [""])[0]
        raise DataError(f"{path}: datasets cannot read it ({type(err).__name__}{': ' + detail if detail else ''})") \
            from None


def _row_format(row: dict[str, Any]) -> str:
    """``"prompt/completion"`` or ``"messages"``: which form one raw row has, or a DataError
    saying what is wrong with it (a row with both, neither, a missing or empty part)."""
    has_pair = row.get("prompt") is not None or row.get("completion") is not None
    has_messages = row.get("messages") is not None
    if has_pair and has_messages:
        raise DataError("it has both 'messages' and 'prompt'/'completion': give one or the other")
    if has_messages:
        answer = to_prompt_completion(row)["completion"][0]  # raises with the reason
        if not str(answer.get("content") or "").strip():
            raise DataError("it has an empty completion (the assistant's message)")
        return "messages"
    if not has_pair:
        raise DataError("it has neither 'prompt' and 'completion' nor 'messages'")
    prompt, completion = row.get("prompt"), row.get("completion")
    for name, value in (("prompt", prompt), ("completion", completion)):
        if value is None:
            raise DataError(f"its {name} is missing (an empty cell or null)")
        if not isinstance(value, (str, list)):
            raise DataError(f"its {name} is a {type(value).__name__}, not text or a list of messages")
    if type(prompt) is not type(completion):
        raise DataError("its prompt and completion are not both text or both lists of messages")
    if isinstance(completion, str) and not completion.strip():
        raise DataError("it has an empty completion")
    return "prompt/completion"


def _where(name: str, path: Path, index: int) -> str:
    """``NAME row I`` (0-based, in the source's order), with the line number for a JSONL file."""
    line = f" (line {index + 1})" if path.suffix.lower() == ".jsonl" else ""
    return f"{name} row {index}{line}"


def _normalised(split, name: str, path: Path):
    """The split in TRL's prompt/completion form; every row checked first, one format per source."""
    columns = split.column_names
    if not ({"prompt", "completion"} <= set(columns) or "messages" in columns):
        raise DataError(f"{name} has columns {columns}: expected 'prompt' and 'completion', or 'messages'")
    first: tuple[int, str] | None = None
    for index, row in enumerate(split):
        try:
            kind = _row_format(row)
        except DataError as err:
            raise DataError(f"{_where(name, path, index)}: {err}") from None
        if first is None:
            first = (index, kind)
        elif kind != first[1]:
            raise DataError(f"{_where(name, path, index)} is a {kind} row, but row {first[0]} is a {first[1]} "
                            "row: use one format per data source")
    if first is not None and first[1] == "messages":
        return split.map(to_prompt_completion, remove_columns=columns)
    return split.select_columns(["prompt", "completion"])


def load_user_data(path: str | Path, eval_examples: int, seed: int = 0, tokenizer=None, context: int | None = None):
    """``(train, held_out)`` ``datasets.Dataset`` s from the user's source (see the module
    docstring); with ``tokenizer`` and ``context``, every row is checked to fit the model
    (:func:`check_fits`, row numbers as in the source)."""
    path = Path(path)
    splits = _load(path)
    if "train" not in splits:
        raise DataError(f"{path}: no 'train' split (found {sorted(splits)})")
    train = _normalised(splits["train"], f"{path} (train)", path)
    held_out = next((splits[s] for s in HELD_OUT_SPLITS if s in splits), None)
    if held_out is not None:
        held_out = _normalised(held_out, f"{path} (held-out)", path)
    if tokenizer is not None:
        check_fits(train, tokenizer, context, f"{path}")
        if held_out is not None:
            check_fits(held_out, tokenizer, context, f"{path} (held-out split)")
    if held_out is None:
        if len(train) < 2 * eval_examples:
            raise DataError(f"{path}: {len(train)} rows are too few to hold out {eval_examples} for evaluation "
                            f"(need {2 * eval_examples}; or give a 'validation' split)")
        parts = train.train_test_split(test_size=eval_examples, seed=seed, shuffle=True)
        train, held_out = parts["train"], parts["test"]
    for name, split in (("train", train), ("held-out", held_out)):
        if len(split) == 0:
            raise DataError(f"{path}: the {name} split is empty")
        for index, completion in enumerate(split["completion"]):
            text = completion if isinstance(completion, str) else " ".join(str(m.get("content", "")) for m in completion)
            if not text.strip():
                raise DataError(f"{path}: {name} row {index} has an empty completion")
    return train, held_out


def check_fits(dataset, tokenizer, context: int, name: str) -> None:
    """Every row's prompt + completion fits in ``context`` tokens (the model's positions); row
    ``i`` is the ``i``-th row of ``dataset`` (0-based)."""
    for index, row in enumerate(dataset):
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, list):  # conversational: as the chat template lays it out
            ids = tokenizer.apply_chat_template(prompt + completion, tokenize=True)
            prompt_ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
            prompt_ids = prompt_ids["input_ids"] if isinstance(prompt_ids, dict) else prompt_ids
        else:
            prompt_ids = tokenizer(prompt)["input_ids"]
            ids = prompt_ids + tokenizer(completion, add_special_tokens=False)["input_ids"]
        if len(prompt_ids) >= context:
            raise DataError(f"{name} row {index}: the prompt is {len(prompt_ids)} tokens, the model's context "
                            f"is {context}")
        if len(ids) + 1 > context:
            raise DataError(f"{name} row {index}: prompt + completion are {len(ids)} tokens, over the model's "
                            f"context of {context}")
