"""The user's guide and the docs site: the site builds with no broken link or anchor (``mkdocs
build --strict``), every ``preft ...`` command in README and docs/ parses with the CLI's own
parser (``preft train`` lines: the recipe and its overrides load too), every source path they name
exists, and the licence and citation files are there."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_FENCES = {"bash", "sh", "shell", "console"}
#: the tree's folders: a path in a command that starts with one of them must exist
SOURCE_FOLDERS = ("recipes/", "docs/", "preft/", "serving/", "eval/", "kernels/", "tests/")
#: flags whose value is a path the command writes, not one it reads
OUTPUT_FLAGS = {"-o", "--output", "--out", "--write-docs"}


def commands(text: str) -> list[tuple[int, str, bool]]:
    """``(line, command, runnable)`` for each ``preft ...`` command: the lines of shell code blocks
    (comments dropped, continuations joined, runnable) and inline code spans (``preft eval`` alone
    names a command; a span may leave out required arguments but not misspell one)."""
    found, lines, fence, index = [], text.splitlines(), None, 0
    while index < len(lines):
        stripped = lines[index].strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "text")
        elif fence in SHELL_FENCES and not stripped.startswith("#"):
            command = lines[index].split(" # ")[0].strip()
            while command.endswith("\\") and index + 1 < len(lines):
                index += 1
                command = command[:-1] + " " + lines[index].split(" # ")[0].strip()
            found += [(index + 1, part, True) for part in re.split(r"\s*(?:&&|;|\||\$\()\s*", command)
                      if part.startswith("preft ")]
        index += 1
    found += [(text[: m.start()].count("\n") + 1, " ".join(m.group(1).split()), False)
              for m in re.finditer(r"`(preft [^`]+)`", text)]
    # "..." elides arguments; lm-eval's arguments are the harness's own parser's
    return [(line, c, runnable) for line, c, runnable in found if "..." not in c and not c.startswith("preft lm-eval")]


def arguments(command: str) -> list[str]:
    """The command's arguments, a placeholder in capitals (``N``, ``DIR``) standing for a value and
    ``[--optional flags]`` unbracketed."""
    words = [("1" if re.fullmatch(r"[A-Z][A-Z_]*", w) else w.strip("[]")) for w in shlex.split(command)[1:]]
    return [w for w in words if w]


def parse_error(argv: list[str]) -> str | None:
    from preft.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exit_:
        if exit_.code:
            return (err.getvalue().strip().splitlines() or [str(exit_.code)])[-1]
    return None


def documented() -> list[tuple[str, str, bool]]:
    return [(f"{page.relative_to(REPO)}:{line}", command, runnable)
            for page in PAGES for line, command, runnable in commands(page.read_text())]


def test_commands_are_found_in_readme_and_docs():
    found = documented()
    assert len(found) > 100
    assert any(c.startswith("preft train recipes/configs/sft_own_data.yaml") for _, c, runnable in found if runnable)


def test_every_documented_command_parses():
    failures = []
    for where, command, runnable in documented():
        error = parse_error(arguments(command))
        if error and (runnable or not re.search(r"required|expected one argument", error)):
            failures.append(f"{where}: {command}\n    {error}")
    assert not failures, "\n".join(failures)


def test_the_check_catches_a_misspelt_flag():
    assert "unrecognized arguments: --stepz" in parse_error(arguments("preft eval loss --stepz 30"))
    assert parse_error(arguments("preft eval loss --steps N --out DIR")) is None


def test_documented_train_commands_load_their_recipe_and_overrides():
    from preft.recipe_config import load_config

    failures = []
    for where, command, runnable in documented():
        argv = arguments(command)
        if not runnable or argv[:1] != ["train"] or len(argv) < 2:
            continue
        try:
            load_config(REPO / argv[1], argv[2:])
        except Exception as err:  # noqa: BLE001 - every failure is listed
            failures.append(f"{where}: {command}\n    {err}")
    assert not failures, "\n".join(failures)


def test_source_paths_in_documented_commands_exist():
    missing = []
    for where, command, _ in documented():
        argv = arguments(command)
        for before, word in zip(["", *argv], argv):
            path = word.split("=", 1)[1] if re.match(r"[\w.]+=", word) else word
            if before in OUTPUT_FLAGS or word.startswith("output_dir="):
                continue
            for piece in path.split(","):
                placeholder = re.search(r"(^|/)[A-Z][A-Z_]*(\.\w+)?$", piece)  # recipes/configs/NAME.yaml
                if piece.startswith(SOURCE_FOLDERS) and not placeholder and not (REPO / piece).exists():
                    missing.append(f"{where}: {piece} (in {command})")
    assert not missing, "\n".join(missing)


def test_the_site_builds_with_no_broken_link(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "RESULTS" / "index.html").is_file()


def test_every_page_is_in_the_site_navigation():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    in_nav = {page for entry in config["nav"] for page in entry.values()}
    assert in_nav == {p.name for p in (REPO / "docs").glob("*.md")}


def test_readme_is_a_short_guide():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert readme.splitlines()[3].startswith("make demo") and readme.splitlines()[4].startswith("make test")
    assert not re.search(r"\b(this session|this round|issue #?\d+)\b", readme, re.IGNORECASE)


def test_licence_and_citation():
    import tomllib

    licence = (REPO / "LICENSE").read_text()
    assert licence.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"
    citation = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and citation["license"] == "Apache-2.0"
    assert citation["title"] and citation["authors"] and citation["message"]
