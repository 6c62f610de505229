"""The README's "Install" section, checked: it installs from a checkout or a wheel ``python -m build``
makes (stagebuf is on no package index), says how the torch build is chosen, and the wheel it names is
the one the build makes, with the extras and entry points the README uses."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import stagebuf

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.index("\n## ", start + 3)
    return text[start:end]


def test_the_install_section_installs_from_a_checkout_or_a_built_wheel() -> None:
    sec = _section("Install")
    flat = " ".join(sec.split())
    assert "not on a package index" in flat
    commands = re.findall(r"pip install [^\n`]*", sec)
    assert commands
    for c in commands:  # every stagebuf install names a local path: nothing comes from an index
        assert not re.search(r"pip install '?stagebuf\b", c), c
    assert "`pip install .`" in sec and "pip install '.[cuda]'" in sec and "python -m build" in sec
    wheel = f"dist/stagebuf-{stagebuf.__version__}-py3-none-any.whl"
    assert f"pip install '{wheel}[cuda]'" in sec
    # how a CUDA or a CPU torch is chosen
    assert "https://download.pytorch.org/whl/cpu" in sec and "CUDA build" in flat and "CPU build" in flat
    setup = " ".join(_section("From a checkout: two commands").split())
    assert "STAGEBUF_TORCH=cpu" in setup and "nvidia-smi" in setup
    script = (ROOT / "scripts" / "setup.sh").read_text()
    assert "STAGEBUF_TORCH" in script and "nvidia-smi" in script and "download.pytorch.org/whl/cpu" in script


def test_the_wheel_the_readme_names_is_what_python_m_build_makes(tmp_path: Path) -> None:
    """Built offline (``--no-isolation``: this environment's setuptools) from a copy of what a checkout
    holds (so nothing is written into it), then run from the wheel alone."""
    src = tmp_path / "checkout"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for f in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / f, src / f)
    out = tmp_path / "dist"
    p = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    name = f"stagebuf-{stagebuf.__version__}-py3-none-any.whl"
    assert [w.name for w in out.glob("*.whl")] == [name]
    with zipfile.ZipFile(out / name) as z:
        files = set(z.namelist())
        dist = f"stagebuf-{stagebuf.__version__}.dist-info"
        meta = z.read(f"{dist}/METADATA").decode()
        entry = z.read(f"{dist}/entry_points.txt").decode()
    assert {"stagebuf/__init__.py", "stagebuf/py.typed", "stagebuf/_tools/doctor.py"} <= files
    assert not any(f.startswith(("benchmarks/", "tests/", "examples/")) for f in files)
    for extra in ("cuda", "cli", "nanovllm"):
        assert f"Provides-Extra: {extra}" in meta
    for checkout_only in ("bench", "test", "docs", "dev"):  # requirements/*.txt: their code is not in it
        assert f"Provides-Extra: {checkout_only}" not in meta
    assert "Requires-Dist: torch>=2.1" in meta
    assert "Author: The stagebuf developers" in meta and "Classifier: Typing :: Typed" in meta
    for py in ("3.10", "3.11", "3.12"):  # requires-python's range, as the code is tested on it
        assert f"Classifier: Programming Language :: Python :: {py}" in meta
    assert "stagebuf = stagebuf._tools.cli:main" in entry and "stagebuf._engines.vllm:register" in entry
    site = tmp_path / "site"
    p = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
         str(out / name)],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import stagebuf, stagebuf._tools.cli as cli; print(stagebuf.__file__); cli.main(['--version'])"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    where, version = p.stdout.strip().splitlines()
    assert where.startswith(str(site)) and version == f"stagebuf {stagebuf.__version__}"


def test_setup_takes_extras_and_requirement_files_and_refuses_any_other_name() -> None:
    """``setup.sh NAME``: a package extra or a requirements file; another name exits 2 naming them all,
    before pip runs (this environment is the one it reuses: ``STAGEBUF_VENV``)."""
    if sys.prefix == sys.base_prefix or not (Path(sys.prefix) / "bin" / "python").is_file():
        pytest.skip("runs setup.sh against this virtual environment: needs to run in one")
    p = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), "test,bogus"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "STAGEBUF_VENV": sys.prefix},
    )  # fmt: skip
    assert p.returncode == 2, p.stdout + p.stderr
    assert "'bogus' is neither an extra nor a requirements file" in p.stderr
    allowed = p.stderr.rsplit("allowed: ", 1)[1].split()
    assert sorted(allowed) == sorted(["cuda", "cli", "nanovllm", "bench", "test", "docs", "dev"])
    for name in ("bench", "test", "docs", "dev"):
        assert (ROOT / "requirements" / f"{name}.txt").is_file()


FAKE_PYTHON = """#!/usr/bin/env bash
# a stand-in interpreter for setup.sh: torch imports; pip prints what $FAKE_PIP says, exiting $FAKE_RC
if [ "$1" = -c ]; then case "$2" in *__version__*) echo 2.13.0+cpu ;; esac; exit 0; fi
if [ "$1 $2" = "-m pip" ]; then printf '%b' "$FAKE_PIP"; exit "${FAKE_RC:-0}"; fi
exit 3
"""
FOREIGN = (
    "WARNING: Location 'file:///opt/pypi-more/simple/rich/' is ignored: "
    "it is neither a file nor a directory.\\n"
    "ERROR: pip's dependency resolver does not currently take into account all the packages that are "
    "installed. This behaviour is the source of the following dependency conflicts.\\n"
    "awscli 1.45.11 requires docutils<=0.19,>=0.18.1, but you have docutils 0.22.4 which is incompatible.\\n"
)


@pytest.mark.parametrize("rc", [0, 1])
def test_setup_keeps_pips_foreign_noise_out_and_shows_its_failures(tmp_path: Path, rc: int) -> None:
    """pip's warnings about the machine's own configuration and its conflicts among the system's packages
    are not printed (one note line for the conflicts; pip's text in the log); a failing pip is shown whole."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    p = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), "test"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "STAGEBUF_VENV": str(venv), "FAKE_PIP": FOREIGN, "FAKE_RC": str(rc)},
    )  # fmt: skip
    out = p.stdout + p.stderr
    log = (venv / "setup-pip.log").read_text()
    assert "is ignored: it is neither a file" in log and "awscli" in log
    if rc == 0:
        assert p.returncode == 0, out
        assert "WARNING:" not in out and "ERROR:" not in out and "awscli" not in out
        assert [line for line in out.splitlines() if "conflicts" in line] == [
            f"setup: note: pip reports version conflicts among packages this machine already had, "
            f"outside {venv} (pip's text: {venv}/setup-pip.log)"
        ]
    else:
        assert p.returncode == 1
        assert "awscli 1.45.11 requires" in p.stderr and "failed (exit 1)" in p.stderr
