"""Every ``>>>`` example in the source runs (``make test`` runs this file): a module's examples
are found by scanning for them, so a new one is tested without being listed."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: source folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"preft": "preft", "serving": "preft.serving", "kernels": "preft.kernels", "eval": "preft.eval",
            "recipes": "preft.recipes"}


def modules_with_examples() -> list[str]:
    names = []
    for folder, package in PACKAGES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            if ">>> " in path.read_text():
                parts = path.relative_to(REPO / folder).with_suffix("").parts
                parts = parts[:-1] if parts[-1] == "__init__" else parts
                names.append(".".join((package, *parts)))
    return names


def test_the_examples_are_found():
    assert {"preft.rule", "preft.serving.scheduling.spec", "preft.serving.prompt_end"} <= set(modules_with_examples())


@pytest.mark.parametrize("name", modules_with_examples())
def test_the_examples_of(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result
