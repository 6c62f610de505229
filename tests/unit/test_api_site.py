"""The API reference site (docs/api) documents every public name, and only public names.

Sphinx documents what its .rst sources name: a public name added to ``stagebuf.__all__``
without a directive would be missing from the site, silently. CI builds the site with
``-W``; this test keeps it complete.
"""

from __future__ import annotations

import re
from pathlib import Path

import stagebuf

API_DIR = Path(__file__).resolve().parents[2] / "docs" / "api"

_DIRECTIVE = re.compile(r"^\.\. (auto\w+|currentmodule|py:currentmodule|py:module)::\s*(\S+)\s*$")
_OPTION = re.compile(r"^\s+:(\w[\w-]*):\s*(.*)$")


def documented(sources: dict[str, str], package: str = "stagebuf") -> set[str]:
    """The names of ``package`` that the .rst ``sources`` document through autodoc.

    Counts ``.. autoclass::``, ``autofunction``, ``autoexception``, ``autodata`` and
    ``automethod`` of ``package.Name`` (or ``Name`` under ``.. currentmodule:: package``),
    and ``.. automodule:: package`` with ``:members:`` (its listed names, or all of
    ``__all__`` when the list is empty).
    """
    out: set[str] = set()
    for text in sources.values():
        module = ""
        lines = text.splitlines()
        for i, line in enumerate(lines):
            m = _DIRECTIVE.match(line)
            if m is None:
                continue
            kind, target = m.groups()
            if kind in ("currentmodule", "py:currentmodule", "py:module"):
                module = target
                continue
            if kind == "automodule":
                if target != package:
                    continue
                for opt in lines[i + 1 :]:
                    o = _OPTION.match(opt)
                    if o is None:
                        break
                    if o.group(1) == "members":
                        listed = [n.strip() for n in o.group(2).split(",") if n.strip()]
                        out.update(listed or stagebuf.__all__)
                continue
            full = target if "." in target else f"{module}.{target}"
            owner, _, name = full.rpartition(".")
            if owner == package:
                out.add(name)
    return out


def _sources() -> dict[str, str]:
    found = {p.name: p.read_text() for p in sorted(API_DIR.glob("*.rst"))}
    assert found, f"no .rst sources in {API_DIR}"
    return found


def test_every_public_name_is_on_the_site():
    missing = sorted(set(stagebuf.__all__) - documented(_sources()))
    assert not missing, f"in stagebuf.__all__ but not in docs/api/*.rst: {missing}"


def test_the_site_names_nothing_outside_all():
    extra = sorted(documented(_sources()) - set(stagebuf.__all__))
    assert not extra, f"documented as stagebuf.<name> but not in stagebuf.__all__: {extra}"


def test_the_check_sees_a_name_dropped_from_the_sources():
    """The check can fail: drop one directive from the real sources and it is reported."""
    sources = _sources()
    name = "make_buffer"
    line = f".. autofunction:: {name}\n"
    holders = [k for k, v in sources.items() if line in v]
    assert holders == ["reference.rst"], holders
    cut = dict(sources, **{holders[0]: sources[holders[0]].replace(line, "")})
    assert name in documented(sources)
    assert name not in documented(cut)
    assert name in set(stagebuf.__all__) - documented(cut)


def test_the_parser_reads_each_form():
    src = {
        "a.rst": "\n".join(
            [
                ".. autoclass:: stagebuf.Tier",
                ".. currentmodule:: stagebuf",
                ".. autofunction:: capabilities",
                ".. autoexception:: UsageError",
                "   :show-inheritance:",
                ".. currentmodule:: stagebuf._engines.vllm",
                ".. autofunction:: register",
                ".. autodata:: stagebuf._engines.vllm.TESTED",
            ]
        ),
        "b.rst": ".. automodule:: stagebuf\n   :members: Step, StepStager\n",
        "c.rst": ".. automodule:: stagebuf\n",
    }
    assert documented(src) == {"Tier", "capabilities", "UsageError", "Step", "StepStager"}
    assert documented({"d.rst": ".. automodule:: stagebuf\n   :members:\n"}) == set(stagebuf.__all__)
