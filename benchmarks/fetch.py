"""Peers' released code, fetched from the package registry at bench or test time (never committed).

:mod:`benchmarks.vllm_mrv2` keeps a few files of each vLLM release's wheel, :mod:`benchmarks.nanovllm_pkg` the
whole nano-vllm-fork wheel; both through :func:`wheel` (``pip download --no-deps``) and :func:`put` (a folder
filled beside its place, then renamed into it: an interrupted fetch leaves nothing a later one would take as
whole). A machine without network (the GPU box) gets the folders carried.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

ENV_CACHE = "STAGEBUF_CACHE_DIR"
"""Where fetched files are kept (else ``$XDG_CACHE_HOME/stagebuf``, else ``~/.cache/stagebuf``)."""


class Unavailable(RuntimeError):
    """A peer's released code could not be had here (the reason says why)."""


def cache_root() -> Path:
    """``$STAGEBUF_CACHE_DIR``, else ``$XDG_CACHE_HOME/stagebuf``, else ``~/.cache/stagebuf``."""
    given = os.environ.get(ENV_CACHE)
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "stagebuf"


@contextmanager
def wheel(requirement: str, *pip_args: str, timeout: float = 900) -> Iterator[Path]:
    """The wheel of ``requirement`` (``pip download --no-deps``, more ``pip_args`` after), in a temporary
    folder for the block; raises Unavailable saying why pip failed."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *pip_args, requirement]
        why = f"pip download {requirement} failed (is the package registry reachable?)"
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable(f"{why}: {e}") from e
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise Unavailable(f"{why}: {tail[0][:300]}")
        yield wheels[0]


_WHY: dict[str, str] = {}


def why_not(key: str, attempt: Callable[[], object]) -> str | None:
    """Why ``attempt()`` (getting a peer's code and loading it) fails here, tried once per ``key``; None:
    it succeeds. It fails by raising Unavailable, or ImportError for something the code needs."""
    if key not in _WHY:
        try:
            attempt()
            _WHY[key] = ""
        except (Unavailable, ImportError) as e:
            _WHY[key] = f"{key}: needs {e.name} ({e})" if isinstance(e, ImportError) else str(e)
    return _WHY[key] or None


def unpacked(
    requirement: str, *pip_args: str, members: Iterable[str] | None = None, timeout: float = 900
) -> Callable[[Path], None]:
    """A :func:`put` filler: the wheel of ``requirement`` unpacked (only ``members``, where given)."""

    def fill(dest: Path) -> None:
        with wheel(requirement, *pip_args, timeout=timeout) as whl:
            try:
                with zipfile.ZipFile(whl) as z:
                    z.extractall(dest, members)
            except (KeyError, zipfile.BadZipFile) as e:
                raise Unavailable(f"{requirement}'s wheel lacks a file the bench needs: {e}") from e

    return fill


def kept(root: Path, complete: Callable[[Path], bool], fill: Callable[[Path], None]) -> Path:
    """``root`` where ``complete(root)``, else made anew by ``fill`` (:func:`put`); raises Unavailable."""
    if not complete(root):
        put(root, fill)
        if not complete(root):
            raise Unavailable(f"{root} is not complete after fetching it")
    return root


def put(root: Path, fill: Callable[[Path], None]) -> Path:
    """``root``, made by ``fill(folder)`` on a new sibling folder renamed into place; an incomplete
    ``root`` is moved aside first, and another process's finished ``root`` wins."""
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
        tmp.chmod(0o755)  # (mkdtemp's 0700) as a folder made by mkdir would be
    except OSError as e:
        raise Unavailable(f"{root.name} cannot be kept in {root.parent}: {e}") from e
    try:
        fill(tmp)
        old: Path | None = root.with_name(f".{root.name}.old.{uuid.uuid4().hex[:8]}")
        try:
            root.rename(old)  # type: ignore[arg-type]
        except OSError:
            old = None
        try:
            tmp.rename(root)
        except OSError:
            if not root.is_dir():
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
