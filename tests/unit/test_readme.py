"""README.md's Python examples, run as written.

Every fenced ``python`` block of README.md is one test case. The blocks form one script read top
to bottom: the case of block i runs, in one fresh namespace, every earlier block that has no
requirement, then block i. So a block may use the names an earlier block defined, and each case
still stands alone (a failing block fails its own case and those after it, not the whole file).

A block that needs CUDA says so on the line just before its fence::

    <!-- requires: cuda -->

Its case carries the ``gpu`` marker: skipped without CUDA (tests/conftest.py, reason "needs a
CUDA device"), run by ``pytest -m gpu`` on a GPU machine. Nothing later may rely on such a block:
it is never run as part of a later case.

A ``print(x)`` line whose comment starts with a Python literal claims what it prints: the case
checks that claim (``# [5, 9, 2]: the first 3 rows`` expects ``[5, 9, 2]``; a list ending in
``...`` only fixes its first elements). Blocks run on the default tier of the machine (HOST on a
CPU-only one, UVA on the H200).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
REQUIREMENTS = {
    "cuda": pytest.mark.gpu,
    # an installed nano-vllm, its model and a GPU; tests/unit/test_nanovllm.py makes the same calls
    "nanovllm": pytest.mark.skip(reason="needs nano-vllm installed, a model and a GPU"),
}
"""What a ``<!-- requires: X -->`` comment may name, and the marker it gives the case."""
MIN_BLOCKS = 7
"""The README has one example per public class (and the CUDA-graph one): fewer means a fence broke."""

_REQUIRES = re.compile(r"^<!--\s*requires:\s*(?P<what>[\w, -]+?)\s*-->\s*$")
_NO_LITERAL = object()


@dataclass
class Block:
    line: int
    """README line of the block's first code line (1-based)."""
    code: str
    requires: list[str] = field(default_factory=list)


def extract(text: str) -> list[Block]:
    """The ``python`` blocks of a Markdown text, with what each requires.

    Raises ValueError for a block that is never closed or a ``requires`` comment that is not
    directly above a ``python`` fence (either would silently drop or run a block).
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _REQUIRES.match(line.strip())
        if m and not (i + 1 < len(lines) and lines[i + 1].strip() == "```python"):
            raise ValueError(f"README.md:{i + 1}: {line.strip()!r} is not directly above a ```python fence")
        if line.strip() == "```python":
            above = _REQUIRES.match(lines[i - 1].strip()) if i else None
            requires = [r.strip() for r in above.group("what").split(",")] if above else []
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise ValueError(f"README.md:{i + 1}: a ```python block is never closed")
            blocks.append(Block(i + 2, "\n".join(lines[i + 1 : end]) + "\n", requires))
            i = end
        i += 1
    return blocks


BLOCKS = extract(README.read_text())


def _params() -> list[Any]:
    out = []
    for b in BLOCKS:
        marks = [REQUIREMENTS[r] for r in b.requires if r in REQUIREMENTS]
        out.append(pytest.param(b, marks=marks, id=f"line{b.line}" + "".join(f"-{r}" for r in b.requires)))
    return out


def _literal(comment: str) -> Any:
    """The longest prefix of ``comment`` that is a Python literal, or _NO_LITERAL."""
    for end in range(len(comment), 0, -1):
        if end < len(comment) and comment[end] not in ",:;":
            continue
        try:
            return ast.literal_eval(comment[:end].strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return _NO_LITERAL


def matches(expected: Any, got: Any) -> bool:
    """``got`` equals ``expected``; a list of ``expected`` ending in ``...`` fixes only its prefix."""
    if isinstance(expected, list):
        if not isinstance(got, list):
            return False
        if expected and expected[-1] is Ellipsis:
            head = expected[:-1]
            return len(got) >= len(head) and all(matches(e, g) for e, g in zip(head, got))
        return len(got) == len(expected) and all(matches(e, g) for e, g in zip(expected, got))
    return type(expected) is type(got) and expected == got if isinstance(expected, bool) else expected == got


def claims(block: Block) -> dict[int, Any]:
    """README line -> the value a one-argument ``print(...)  # literal`` line claims it prints."""
    out = {}
    for k, src in enumerate(block.code.splitlines()):
        code, sep, comment = src.partition("#")
        if not sep or not code.strip().startswith("print("):
            continue
        try:
            call = ast.parse(code.strip()).body[0]
        except SyntaxError:  # a call over several lines, or a '#' inside a string: no claim
            continue
        if not (
            isinstance(call, ast.Expr) and isinstance(call.value, ast.Call) and len(call.value.args) == 1
        ):
            continue
        value = _literal(comment.strip())
        if value is not _NO_LITERAL:
            out[block.line + k] = value
    return out


def run(blocks: list[Block]) -> dict[int, list[Any]]:
    """Run ``blocks`` in order in one namespace; README line -> the arguments printed there."""
    printed: dict[int, list[Any]] = {}

    def record(*args: Any, **kwargs: Any) -> None:
        frame = sys._getframe(1)
        if frame.f_code.co_filename == str(README):
            printed.setdefault(frame.f_lineno, []).append(args)
        print(*args, **kwargs)

    ns: dict[str, Any] = {"__name__": "__readme__", "print": record}
    for b in blocks:
        # blank lines in front, so that line numbers in a traceback are README.md's own
        exec(compile("\n" * (b.line - 1) + b.code, str(README), "exec"), ns)
    return printed


@pytest.mark.parametrize("block", _params())
def test_readme_block_runs_as_written(block: Block) -> None:
    earlier = [b for b in BLOCKS[: BLOCKS.index(block)] if not b.requires]
    printed = run([*earlier, block])
    for line, want in claims(block).items():
        assert line in printed, f"README.md:{line} claims to print {want!r} but never printed"
        got = printed[line][-1][0]
        assert matches(want, got), f"README.md:{line} claims to print {want!r}; it printed {got!r}"


def test_every_block_is_run_or_skipped_for_cuda() -> None:
    fences = re.findall(r"^```python\s*$", README.read_text(), flags=re.M)
    assert len(BLOCKS) >= MIN_BLOCKS, f"README.md has {len(BLOCKS)} python blocks; expected >= {MIN_BLOCKS}"
    assert len(BLOCKS) == len(fences), "every ```python fence must be one extracted block"
    for b in BLOCKS:
        unknown = set(b.requires) - set(REQUIREMENTS)
        assert not unknown, f"README.md:{b.line}: unknown requirement {unknown}; allowed: {set(REQUIREMENTS)}"
        assert b.code.strip(), f"README.md:{b.line}: an empty python block"
        compile(b.code, f"README.md:{b.line}", "exec")  # a syntax error fails here, even in a CUDA block
    params = _params()
    for b, p in zip(BLOCKS, params):
        has_gpu = any(m.name == "gpu" for m in p.marks)
        assert has_gpu == ("cuda" in b.requires), (
            f"README.md:{b.line}: the gpu marker must follow requires: cuda"
        )
    # the prose says the blocks run in order: at least one needs CUDA, so the skip path is exercised
    assert any("cuda" in b.requires for b in BLOCKS)


def test_extractor_catches_broken_fences() -> None:
    good = "text\n<!-- requires: cuda -->\n```python\nx = 1\n```\n\n```python\ny = x\n```\n"
    got = extract(good)
    assert [(b.line, b.code, b.requires) for b in got] == [(4, "x = 1\n", ["cuda"]), (8, "y = x\n", [])]
    with pytest.raises(ValueError, match="never closed"):
        extract("```python\nx = 1\n")
    with pytest.raises(ValueError, match="not directly above"):
        extract("<!-- requires: cuda -->\n\n```python\nx = 1\n```\n")


def test_claims_are_checked() -> None:
    """A README that claims the wrong output must fail: the check compares against the literal."""
    b = Block(1, "print([1, 2, 3])  # [1, 2, 4]\nprint([1, 2, 3])  # [1, 2, ...]: a prefix\n")
    c = claims(b)
    assert c == {1: [1, 2, 4], 2: [1, 2, Ellipsis]}
    assert not matches(c[1], [1, 2, 3]) and matches(c[2], [1, 2, 3])
    assert not matches(True, 1) and matches(0.5, 0.5) and not matches([1], [1, 2])


def test_the_contracts_timeline_is_drawn_by_its_script(tmp_path: Path) -> None:
    """README's timeline picture is docs/timeline.png, which scripts/timeline.py draws; its schedule
    keeps the contract: a step begins in a slot only after the device read the step two before."""
    pytest.importorskip("matplotlib")
    import importlib.util

    spec = importlib.util.spec_from_file_location("timeline", README.parent / "scripts" / "timeline.py")
    assert spec is not None and spec.loader is not None
    tl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tl)
    assert "](docs/timeline.png)" in README.read_text() and tl.DEFAULT.is_file()
    sched = tl.schedule(6)
    for i, st in enumerate(sched):
        assert st["published"] == st["begin"] + tl.STAGE and st["read"] >= st["published"]
        if i >= 2:
            assert st["begin"] >= sched[i - 2]["read_end"]  # the guard
        if i >= 1:
            assert st["read"] >= sched[i - 1]["read_end"]  # one stream
    assert any(st["begin"] > st["ready"] for st in sched)  # the picture shows the guard waiting
    tl.draw(tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
