"""Sphinx configuration of stagebuf's API reference: autodoc over the public API, NumPy-style docstrings.

Build it (after ``bash scripts/setup.sh docs``) with warnings as errors, as CI does::

    .venv/bin/python -m sphinx -E -W --keep-going -b html docs/api build/api

``-E`` reads every source again, so that no warning hides in a cached one. stagebuf is imported
from the environment that runs Sphinx (set-up installs it editable). No extension reaches the
network: intersphinx is off.
"""

from __future__ import annotations

import re
from typing import Any

import stagebuf

project = "stagebuf"
author = "the stagebuf authors"
copyright = "the stagebuf authors; Apache-2.0"
release = version = stagebuf.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]

napoleon_google_docstring = False
napoleon_numpy_docstring = True
# Attributes sections as :ivar: fields: no second entry for an attribute autodoc also lists
napoleon_use_ivar = True

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# signatures name the type aliases (documented on the reference page) instead of expanding them
autodoc_type_aliases = {
    name: f"~stagebuf._common.types.{name}" for name in ("DeviceLike", "DTypeLike", "HostData")
}

exclude_patterns: list[str] = []
html_theme = "alabaster"
html_title = f"stagebuf {release} API reference"
html_show_sourcelink = False


def _fix(text: str | None) -> str | None:
    # Sphinx 9 writes an alias inside a union ("DTypeLike | None") as TypeAliasForwardRef('...')
    return re.sub(r"TypeAliasForwardRef\('([~\w.]+)'\)", r"\1", text) if text else text


def _alias_names(
    app: Any, what: str, name: str, obj: Any, options: Any, sig: str | None, ret: str | None
) -> tuple[str | None, str | None]:
    return _fix(sig), _fix(ret)


def setup(app: Any) -> None:
    app.connect("autodoc-process-signature", _alias_names)
