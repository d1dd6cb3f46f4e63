"""One file written whole or not at all: the text goes to a temporary file in the same
directory, which is then renamed over the target (``os.replace`` is atomic on one file system),
so a reader never sees half a file and a crash leaves the old one. The scheduling state files
(step cost models, the online model's state, Feather's table) and the workload traces use it.

>>> import pathlib, tempfile
>>> path = pathlib.Path(tempfile.mkdtemp()) / "state.json"
>>> write_atomically(path, '{"a": 1}\\n').read_text()
'{"a": 1}\\n'
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` (its directory made if missing) atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)  # only the temporary file this call made
        raise
    return path
