"""Peers' released code, fetched from the package registry at bench or test time (never committed).

Wheels come through :func:`wheel` (``pip download --no-deps``) into folders made by :func:`put` (filled beside
their place, then renamed into it: an interrupted fetch leaves nothing whole). A machine without network (the
GPU box) gets the folders carried.
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

ENV_CACHE = "STAGEBUF_CACHE_DIR"  # Where fetched files are kept (see cache_root).


class Unavailable(RuntimeError):
    """A peer's released code could not be had here (the reason says why)."""


def cache_root() -> Path:
    """``$STAGEBUF_CACHE_DIR``, else ``$XDG_CACHE_HOME/stagebuf``, else ``~/.cache/stagebuf``."""
    given = os.environ.get(ENV_CACHE)
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "stagebuf"


def pip(what: str, *args: str, timeout: float, done: Callable[[str], bool] = lambda out: True) -> str:
    """``pip WHAT ARGS``' output where it succeeds and ``done(output)``, else raises Unavailable."""
    why = f"pip {what} failed (is the package registry reachable?)"
    try:
        cmd = [sys.executable, "-m", "pip", *what.split(), *args]
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"{why}: {e}") from e
    if got.returncode != 0 or not done(got.stdout):
        tail = (got.stderr or got.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Unavailable(f"{why}: {tail[0][:300]}")
    return got.stdout


@contextmanager
def wheel(requirement: str, *pip_args: str, timeout: float = 900) -> Iterator[Path]:
    """The wheel of ``requirement`` (``pip download --no-deps``), in a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        done = lambda _: any(Path(tmp).glob("*.whl"))
        pip(f"download {requirement}", "--no-deps", "-q", "-d", tmp, *pip_args, timeout=timeout, done=done)
        yield next(Path(tmp).glob("*.whl"))


_WHY: dict[str, str] = {}


def why_not(key: str, attempt: Callable[[], object]) -> str | None:
    """Why ``attempt()`` raises Unavailable or ImportError here (tried once per ``key``), or None."""
    if key not in _WHY:
        try:
            attempt()
            _WHY[key] = ""
        except (Unavailable, ImportError) as e:
            _WHY[key] = f"{key}: needs {e.name} ({e})" if isinstance(e, ImportError) else str(e)
    return _WHY[key] or None


def binary(platform: str, py: str) -> tuple[str, ...]:
    """``pip download``'s arguments for CPython ``py``'s wheel on ``platform`` (not this machine's)."""
    return ("--only-binary=:all:", "--platform", platform, "--python-version", py, "--implementation", "cp")


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
    """``root``, filled on a sibling folder renamed into place (another process's finished one wins)."""
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
