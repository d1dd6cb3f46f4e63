"""The tree's shape: no import circle in ``preft/``, the rule depends on numpy alone, and the
bundle's checks exist once (issue: house II)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import preft

PACKAGE = Path(preft.__file__).parent


def module_imports(path: Path) -> set[str]:
    """The ``preft.*`` modules ``path`` imports, at module level or inside a function (a lazy
    import that closes a circle is still a circle)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y, inside the package of path
                package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                found.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name == "preft" or name.startswith("preft.")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circle_in_preft():
    files = [p for p in PACKAGE.rglob("*.py") if p.is_file()]
    modules = {module_name(p): p for p in files}
    graph = {name: {m for m in module_imports(path) if m in modules and m != name} for name, path in modules.items()}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return trail + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    # a package imports its submodules by design (preft/__init__ re-exports): only module-to-module circles count
    circles = [c for c in (cycle_from(name) for name in graph) if c and not any(
        modules[m].name == "__init__.py" for m in c)]
    assert not circles, circles[:3]


def test_the_rule_depends_on_numpy_alone():
    tree = ast.parse((PACKAGE / "rule.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"numpy", "__future__", "dataclasses", "typing"}, imported


@pytest.mark.parametrize("field, value", [("adapter_start", -1), ("adapter_start", "3"), ("prefill_only", "yes")])
def test_read_manifest_checks_the_recorded_rule(tmp_path, field, value):
    import json

    from preft.bundle import BUNDLE_FORMAT, MANIFEST, BundleError, read_manifest

    (tmp_path / MANIFEST).write_text(json.dumps({"format": BUNDLE_FORMAT, "kind": "lora", "rank": 4, field: value}))
    with pytest.raises(BundleError, match=field):
        read_manifest(tmp_path)


def test_the_scheduler_spec_is_parsed_in_one_module_and_envs_lists_its_keys():
    """``--scheduler`` names are split in serving/scheduling/spec.py alone (no substring tests
    elsewhere), and preft/envs.py documents every key of ``PREFT_SCHEDULER``."""
    import re

    from preft import envs
    from preft.serving.scheduling.spec import SETTINGS, SchedulerSpec

    repo = PACKAGE.parent
    sources = [p for d in ("preft", "serving", "eval") for p in (repo / d).rglob("*.py")]
    splitting = re.compile(r"""\.split\(["']\+["']\)"""
                           r"""|["'](wavepp|sloweave|feather)["'] in [\w.\[\]"']*(name|order|scheduler)""")
    found = sorted(str(p.relative_to(repo)) for p in sources if splitting.search(p.read_text()))
    assert found == ["serving/scheduling/spec.py"], found
    described = envs.VARIABLES["PREFT_SCHEDULER"][1]
    assert all(key in described for key in {"name", *SETTINGS}), described
    with pytest.raises(ValueError, match="unknown key"):
        SchedulerSpec.from_json({"name": "sloweave", "tpot": 25})
    with pytest.raises(ValueError, match="tpot_ms must be a number > 0"):
        SchedulerSpec.parse("sloweave", tpot_ms=-1)
