"""The Markdown docs stay a reference: short, and free of run-to-run history.

**Size.** README.md and docs/*.md together hold fewer than ``LIMIT`` words, counted as ``wc -w``
counts them (runs of bytes other than ASCII whitespace), generated tables and code included.

**No commit hashes in prose.** History lives in git: the docs name a commit only where a table or
figure of measured figures says what produced it. A *commit hash* is a whole word of 7 to 40
characters ``0-9a-f`` holding at least one digit and one letter. Outside fenced code blocks, a line
may hold one only if it is a *caption*, which here means one line of the Markdown source that:

- is not a table row (its first non-blank character is not ``|`` and it has no `` | `` cell
  separator), so a table never carries a hash per row;
- names a machine: ``nvidia-h200`` (``-x2`` etc.) or ``NVIDIA H200``, or ``CPU``;
- names the command that made the figures, in backticks: a span whose first word (after any
  ``NAME=value`` settings) is ``python``, ``python3``, ``bash``, ``pytest``, ``.venv/bin/...`` or
  ``scripts/...``;
- writes every hash on it as ``commit `<hash>``` (the word "commit", then the hash in backticks).

So ``<sub>`nvidia-h200`, `python -m benchmarks` at commit `1234abc`: medians of ...</sub>`` is a
caption; "at 1234abc we measured" or a table column of commits is not.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 8000
"""README.md plus docs/*.md must stay below this many words."""

HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
MACHINE = re.compile(r"nvidia-h200(?:-x\d+)?|NVIDIA H200|\bCPU\b")
COMMAND = re.compile(
    r"`(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"  # NAME=value settings first
    r"(?:python3?|bash|pytest|\.venv/bin/\S+|scripts/\S+)(?:\s[^`]*)?`"
)
COMMIT = re.compile(r"commit `([0-9a-f]{7,40})`")


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def words(text: str) -> int:
    """What ``wc -w`` counts: runs of bytes that are not ASCII whitespace."""
    return len(re.findall(rb"[^ \t\n\v\f\r]+", text.encode()))


def is_caption(line: str) -> bool:
    s = line.strip()
    if s.startswith("|") or " | " in s:
        return False
    if not (MACHINE.search(s) and COMMAND.search(s)):
        return False
    return sorted(HASH.findall(s)) == sorted(COMMIT.findall(s))


def hashes_in_prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code that holds a hash and is no caption."""
    found = []
    fence = False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
            continue
        if not fence and HASH.search(line) and not is_caption(line):
            found.append((i, line.strip()))
    return found


def test_readme_and_docs_stay_under_the_word_limit() -> None:
    counts = {p.relative_to(ROOT).as_posix(): words(p.read_text(encoding="utf-8")) for p in docs()}
    total = sum(counts.values())
    assert total < LIMIT, f"README.md + docs/*.md hold {total} words (limit {LIMIT}): {counts}"


@pytest.mark.parametrize("path", docs(), ids=lambda p: p.name)
def test_no_commit_hash_outside_captions(path: Path) -> None:
    found = hashes_in_prose(path.read_text(encoding="utf-8"))
    where = "\n".join(f"{path.relative_to(ROOT)}:{i}: {line}" for i, line in found)
    assert not found, f"a commit hash outside a caption (history belongs in git):\n{where}"


def test_the_rules_catch_what_they_name() -> None:
    assert words("a  b\tc\n`d e`|f | g\u00a0h") == 7  # as wc -w: NBSP is not ASCII whitespace
    caption = "<sub>`nvidia-h200`, `python -m benchmarks --rounds 3` at commit `630d317`: medians</sub>"
    assert is_caption(caption)
    assert is_caption("Run: `python -m benchmarks --json b.json` at commit `7f9c320` on NVIDIA H200, 2026.")
    assert is_caption("CPU, `PYTHONPATH=src python3 scripts/path_count.py`, commit `e7fbafe`:")
    assert not is_caption("At 7f9c320 on `nvidia-h200` we measured `python -m benchmarks` again.")
    assert not is_caption("`nvidia-h200`, `python -m benchmarks` at commit `630d317`, before it `254ce1f`")
    assert not is_caption("`nvidia-h200` | `python -m benchmarks` | commit `630d317`")  # a table row
    assert not is_caption("an earlier run at commit `630d317` was slower")  # no machine, no command
    text = "x\n```\nabc1234\n```\nwas 0.766 at b333f49, now 0.897\n| a | 298eb31 |\n"
    assert hashes_in_prose(text) == [(5, "was 0.766 at b333f49, now 0.897"), (6, "| a | 298eb31 |")]
    for word in ("deadbeef", "20260210", "e2e", "0xFF", "1e300", "abc123"):  # no hash
        assert not HASH.search(word), word
