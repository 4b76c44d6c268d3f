"""The tools (tools/): at most five entry points, each with argparse subcommands, and every tool command or path that
the README, docs, notes and tests cite exists. The tools run as programs (`--help`), never imported."""

import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINTS = sorted(path.name for path in (ROOT / "tools").glob("*.py"))
CITING = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "kernels").glob("*/NOTES.md")),
          *sorted((ROOT / "tests").glob("*.py")), ROOT / ".ci" / "run"]


@lru_cache(maxsize=None)
def subcommands(tool):
    """The subcommands that `python tools/<tool> --help` lists (argparse's indented choices)."""
    text = subprocess.run([sys.executable, f"tools/{tool}", "--help"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    listing = text.split("positional arguments:", 1)[1].split("\noptions:", 1)[0]
    return set(re.findall(r"^    ([a-z][a-z0-9-]*)\b", listing, flags=re.MULTILINE))


def test_at_most_five_entry_points():
    assert 1 <= len(ENTRY_POINTS) <= 5, ENTRY_POINTS


@pytest.mark.parametrize("tool", ENTRY_POINTS)
def test_each_entry_point_lists_its_subcommands(tool):
    assert len(subcommands(tool)) >= 2, tool


def citations():
    """(file, tool path, the words after it) for every `tools/...` cited: inside backticks, a command's words too."""
    found = []
    for path in CITING:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"tools/[\w/]+\.(?:py|c)", text):
            found.append((path.relative_to(ROOT).as_posix(), match.group(0), ""))
        for match in re.finditer(r"`(?:python )?(tools/\w+\.py)( [^`]*)?`", text):
            found.append((path.relative_to(ROOT).as_posix(), match.group(1), match.group(2) or ""))
    return found


def cited_subcommand(words):
    """The subcommand a cited command names: its first word that is not an option (nor --path's value), where it is
    a lowercase word; None where there is none (a placeholder such as SUBCOMMAND or [--path PATH])."""
    tokens = words.split()
    while tokens[:1] == ["--path"]:
        tokens = tokens[2:]
    return tokens[0] if tokens and re.fullmatch(r"[a-z][a-z0-9-]*", tokens[0]) else None


@pytest.mark.parametrize("where, tool, words", citations())
def test_cited_tools_and_subcommands_exist(where, tool, words):
    assert (ROOT / tool).is_file(), f"{where} cites {tool}, which does not exist"
    subcommand = cited_subcommand(words)
    if subcommand is not None and tool.count("/") == 1:
        assert subcommand in subcommands(Path(tool).name), f"{where}: {tool} has no subcommand {subcommand}"


def test_sanitize_cases_groups_are_checked_before_a_build():
    # device_check.py reads the groups from sanitize_cases.py's source: a misspelt group fails at once, naming them.
    run = subprocess.run([sys.executable, "tools/device_check.py", "sanitize", "--cases", "rotry"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 2 and "invalid choice: 'rotry'" in run.stderr
    assert all(f"'{group}'" in run.stderr for group in ("elementwise", "gemm", "rotary", "attention")), run.stderr
