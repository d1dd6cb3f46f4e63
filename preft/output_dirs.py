"""Directories PreFT writes into are its own: a user's files are never overwritten or deleted.

A command that writes into a directory first *claims* it (:func:`claim`). The claim holds when
the directory does not exist or is empty (it is then made PreFT's: a marker file
:data:`MARKER` records who made it and a run id), when it is PreFT's own directory of the
same kind and the command continues what is there (``resume``: ``preft train ...
resume_from_checkpoint=true``; the results directory of ``preft eval``), or when the user
asked to overwrite it explicitly. Anything else is one error that names the directory and the
way out. Checkpoints carry the run id of the run that wrote them
(:mod:`preft.trainers.checkpoints`), and checkpoint rotation deletes only those.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp()) / "run"
>>> run_id = claim(d, "train:sft", resume=False, overwrite=False, how_to_overwrite="overwrite_output_dir=true")
>>> owner(d)["kind"], owner(d)["run_id"] == run_id
('train:sft', True)
>>> (d / "notes.txt").write_text("mine") and None
>>> claim(d, "train:sft", resume=False, overwrite=False, how_to_overwrite="overwrite_output_dir=true")
Traceback (most recent call last):
...
ValueError: ... is not empty and holds no run to resume ...
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

#: the file in a directory PreFT made: {"kind": ..., "run_id": ...}
MARKER = ".preft_owner.json"


def owner(directory: str | Path) -> dict | None:
    """What the marker of ``directory`` says (None: no marker, or not one PreFT wrote)."""
    try:
        found = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and isinstance(found.get("run_id"), str) else None


def check_claim(directory: str | Path, kind: str, *, resume: bool, overwrite: bool,
                how_to_overwrite: str | None, resume_unmarked: bool = False) -> str:
    """Whether ``directory`` may become this command's to write into: the run id it would write
    under, or a ``ValueError`` that says why not. Nothing is written (every process of a
    distributed run checks; one writes, :func:`mark`).

    ``kind`` names the work (``"train:sft"``, ``"eval"``, ``"demo"``); ``resume``: the command
    continues a run of the same kind there (its run id is kept); ``overwrite``: the user's
    explicit flag, spelled ``how_to_overwrite`` in the error (None: the command has none);
    ``resume_unmarked``: a directory without a marker may be resumed too (``preft train
    resume_from_checkpoint=true`` on a run from before the markers: the user asked for it)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"output directory {directory} is a file, not a directory")
    found = owner(directory) if directory.is_dir() else None
    empty = not directory.exists() or not any(directory.iterdir())
    if empty or overwrite:
        return uuid.uuid4().hex
    if resume and found is not None and found.get("kind") == kind:
        return found["run_id"]
    if resume and resume_unmarked and found is None:  # a run from before these markers, by explicit request
        return uuid.uuid4().hex
    made_by = f"it was made by another kind of PreFT run ({found.get('kind')})" if found else "PreFT did not make it"
    way_out = f", or pass {how_to_overwrite} to write over it (checkpoints another run wrote are never deleted)" \
        if how_to_overwrite else ""
    raise ValueError(f"output directory {directory} is not empty and holds no run to resume ({made_by}): choose an "
                     f"empty or new directory{way_out}")


def mark(directory: str | Path, kind: str, run_id: str) -> None:
    """Make ``directory`` (and its parents) and record it as PreFT's, for ``kind`` and ``run_id``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    temp = directory / f".{MARKER}.{os.getpid()}.tmp"
    temp.write_text(json.dumps({"kind": kind, "run_id": run_id}) + "\n")
    os.replace(temp, directory / MARKER)


def claim(directory: str | Path, kind: str, *, resume: bool, overwrite: bool, how_to_overwrite: str | None) -> str:
    """:func:`check_claim`, then :func:`mark`: the directory is this command's; its run id."""
    run_id = check_claim(directory, kind, resume=resume, overwrite=overwrite, how_to_overwrite=how_to_overwrite)
    mark(directory, kind, run_id)
    return run_id
