"""A copy of the repository on ``PYTHONPATH``, not installed (a torch-only GPU machine): the
subpackages that live beside ``preft/`` found where the installed package would map them.

The installed package maps ``preft.recipes``, ``preft.serving``, ``preft.kernels`` and
``preft.eval`` to the repository's top-level folders (``pyproject.toml``'s ``package-dir``).
:func:`install` puts a finder after every other one on ``sys.meta_path`` that does the same
mapping from the folder above ``preft/``; an installed package is found first and wins.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: ``preft.NAME`` -> its folder in the repository (pyproject.toml's package-dir)
SUBPACKAGES = {"preft.recipes": "recipes", "preft.serving": "serving", "preft.kernels": "kernels",
               "preft.eval": "eval"}


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        folder = SUBPACKAGES.get(name)
        init = ROOT / folder / "__init__.py" if folder else None
        if init is None or not init.is_file():
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])


def install() -> None:
    if not any(isinstance(finder, SourceTreeFinder) for finder in sys.meta_path):
        sys.meta_path.append(SourceTreeFinder())
