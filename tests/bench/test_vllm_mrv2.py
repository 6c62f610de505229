"""The harness that runs vLLM's own MRV2 code (``benchmarks.vllm_mrv2``): the release matrix, where a
release's files are kept and how they are fetched, the check for a newer release on the registry, and
the stand-ins that differ by release."""

from __future__ import annotations

import array
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks import vllm_mrv2 as V

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


# --- the matrix ------------------------------------------------------------------------------------


def test_the_matrix_is_ordered_newest_last_and_every_function_defaults_to_it() -> None:
    import inspect

    nums = [V._version(r) or () for r in V.RELEASES]
    assert all(nums) and nums == sorted(nums) and (V._version(V.OLDEST_CHECKED) or ()) <= nums[0]
    assert list(V.RELEASES)[-1] == V.NEWEST

    for fn in (V.fetch, V.available, V.cache_dir, V.load, V.as_installed, V.stagebuf_buffer_utils, V.files):
        assert inspect.signature(fn).parameters["release"].default == V.NEWEST, fn.__name__
    assert not hasattr(V, "VERSION")


def test_an_unknown_release_is_refused_naming_the_known_ones() -> None:
    for call in (lambda: V.load(release="0.31.0"), lambda: V.cache_dir("0.31.0"), lambda: V.fetch("0.31.0")):
        with pytest.raises(ValueError, match=f"'0.31.0' is not in RELEASES; known: {', '.join(V.RELEASES)}"):
            call()


# --- a newer release on the registry --------------------------------------------------------------


def _next(minor_step: int, patch: int = 0) -> str:
    major, minor, _ = V.NEWEST.split(".")
    return f"{major}.{int(minor) + minor_step}.{patch}"


def test_newer_releases_are_read_from_pips_listing() -> None:
    """``pip index versions vllm``'s output: the final releases newer than the matrix, oldest first."""
    new, newer = _next(1), _next(1, 1)
    listing = (
        f"vllm ({newer})\n"
        f"Available versions: {newer}, {new}, {_next(2)}rc1, {new}.dev3, {V.NEWEST}, {V.OLDEST_CHECKED}, "
        "0.10.1.1, 0.9.2\n"
        f"  INSTALLED: {V.NEWEST}\n  LATEST:    {newer}\n"
    )
    assert V.newer_releases(listing) == [new, newer]
    older = "Available versions: " + ", ".join(reversed(list(V.RELEASES))) + ", 0.10.1.1\n"
    assert V.newer_releases(older) == []
    with pytest.raises(ValueError, match="Available versions"):
        V.newer_releases("ERROR: No matching distribution found for vllm\n")


def test_the_registry_has_no_vllm_release_newer_than_the_matrix() -> None:
    """Asks the package registry (skips where it cannot be reached): a newer vLLM release is a warning
    in pytest's summary naming it, the sign to add it to RELEASES (benchmarks/vllm_mrv2.py)."""
    try:
        new = V.newer_releases()
    except V.Unavailable as e:
        pytest.skip(f"the package registry cannot be asked: {e}")
    if new:
        warnings.warn(
            f"vLLM {', '.join(new)} is released, newer than the harness's newest ({V.NEWEST}): add "
            f"{new[-1]} to RELEASES in benchmarks/vllm_mrv2.py (and its differences), and to "
            "stagebuf._engines.vllm_check.RELEASES once reviewed",
            UserWarning,
            stacklevel=1,
        )


@pytest.mark.parametrize(("found", "status"), [([], 0), (["9.9.0"], 1), (None, 2)])
def test_check_new_says_what_it_found_in_its_exit_status(
    found: list[str] | None, status: int, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    def newer(listing: str | None = None) -> list[str]:
        if found is None:
            raise V.Unavailable("pip index versions vllm failed: no network")
        return found

    monkeypatch.setattr(V, "newer_releases", newer)
    assert V.main(["--check-new"]) == status
    out = capsys.readouterr()
    if status == 1:
        assert "9.9.0" in out.out and "RELEASES" in out.out
    elif status == 2:
        assert "cannot check for newer vLLM releases" in out.err and "no network" in out.err
    else:
        assert f"no vLLM release newer than {V.NEWEST}" in out.out


def test_check_new_without_the_registry_exits_2_saying_so(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL="http://127.0.0.1:9/simple",
        PIP_RETRIES="0",
        PIP_TIMEOUT="5",
    )
    cmd = [sys.executable, "-m", "benchmarks.vllm_mrv2", "--check-new"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "cannot check for newer vLLM releases" in p.stderr and "registry" in p.stderr


# --- where the files are kept ----------------------------------------------------------------------


def test_the_cache_is_per_user_outside_the_checkout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in (V.ENV_CACHE, V.ENV_DIR, "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    r = V.NEWEST
    assert V.cache_dir(r) == tmp_path / "home/.cache/stagebuf" / f"vllm-{r}"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert V.cache_dir(r) == tmp_path / "xdg/stagebuf" / f"vllm-{r}"
    monkeypatch.setenv(V.ENV_CACHE, str(tmp_path / "mine"))
    assert V.cache_dir(r) == tmp_path / "mine" / f"vllm-{r}"
    monkeypatch.setenv(V.ENV_DIR, str(tmp_path / "carried"))  # a folder of vllm-<release> folders
    assert [V.cache_dir(x) for x in V.RELEASES] == [tmp_path / "carried" / f"vllm-{x}" for x in V.RELEASES]


def _fake_wheel(source: Path, fail_after: int | None = None) -> Any:
    """A ``_filler`` copying a fetched release's files (``fail_after`` files, then interrupted)."""

    def filler(release: str) -> Any:
        def fill(dest: Path) -> None:
            for i, f in enumerate(V.files(release)):
                if fail_after is not None and i == fail_after:
                    raise KeyboardInterrupt
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                (dest / f).write_bytes((source / f).read_bytes())

        return fill

    return filler


def test_an_interrupted_fetch_leaves_no_part_of_a_release(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    r = V.NEWEST
    if V.available(r):
        pytest.skip(f"needs vLLM {r}'s files: {V.available(r)}")
    have = V.fetch(r)
    monkeypatch.setenv(V.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(V, "_filler", _fake_wheel(have, fail_after=3))
    with pytest.raises(KeyboardInterrupt):
        V.fetch(r)
    assert list(tmp_path.iterdir()) == []  # neither the release's folder nor the temporary one
    # an incomplete folder (an older harness's: no model_runner.py) is replaced whole
    old = tmp_path / f"vllm-{r}"
    (old / "vllm/v1/worker/gpu").mkdir(parents=True)
    (old / "vllm/v1/worker/gpu/buffer_utils.py").write_text("# partial\n")
    monkeypatch.setattr(V, "_filler", _fake_wheel(have))
    assert V.fetch(r) == old and V._have(old, r)
    assert (old / "vllm/v1/worker/gpu/buffer_utils.py").read_bytes() == (
        have / "vllm/v1/worker/gpu/buffer_utils.py"
    ).read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == [f"vllm-{r}"]


# --- what differs by release -------------------------------------------------------------------------


@pytest.mark.usefixtures("triton_interpreted")
def test_each_release_runs_its_own_files_and_says_so(vllm_release: str) -> None:
    m = V.load("vllm", device=CPU, release=vllm_release)
    where = V.cache_dir(vllm_release)
    for mod in (m.buffer_utils, m.block_table, m.states, m.input_batch, m.sample_states):
        assert Path(mod.__file__).is_relative_to(where), mod.__file__
    assert m.release == vllm_release and m.spec is V.RELEASES[vllm_release]
    assert m.buffer_utils.logger.release == vllm_release  # its lines read "vLLM <release>: ..."
    assert V.stagebuf_buffer_utils(m.buffer_utils, vllm_release).__name__.endswith(
        f"[{vllm_release}, stagebuf]"
    )


def test_the_bench_substitutes_the_plugins_names_by_public_name() -> None:
    import stagebuf
    from stagebuf._engines.vllm import OURS

    # The bench also runs older packages (compare, ab), so it reads these names from stagebuf's face.
    assert set(V.SUBSTITUTED) == set(OURS) and set(V.SUBSTITUTED) <= set(stagebuf.__all__)
    assert all(getattr(stagebuf, n) is OURS[n] for n in V.SUBSTITUTED)


@pytest.mark.usefixtures("triton_interpreted")
def test_token_buffer_is_the_releases_own_class(vllm_release: str) -> None:
    tb = V.token_buffer(vllm_release)
    if not V.RELEASES[vllm_release].token_buffer:
        assert tb is None and V.load("vllm", device=CPU, release=vllm_release).TokenBuffer is None
        return
    assert tb is V.load("vllm", device=CPU, release=vllm_release).TokenBuffer  # one class per release
    assert tb is V.load("stagebuf", device=CPU, release=vllm_release).TokenBuffer
    assert issubclass(tb, array.array)
    assert Path(sys.modules[tb.__module__].__file__).is_relative_to(V.cache_dir(vllm_release))
    t = tb([1, 2, 3])
    assert t.typecode == "i" and t == [1, 2, 3] and t[1:] == [2, 3]  # vLLM's own list-like behaviour


@pytest.mark.usefixtures("triton_interpreted")
def test_the_confidential_computing_stand_ins(
    vllm_release: str, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """Where the release asks the platform about confidential computing (0.34 on), the stand-in answers
    ``CONFIDENTIAL_COMPUTE`` (False unless a test sets it), and vLLM's own NonUvaBuffer reacts to it."""
    m = V.load("vllm", pin=False, uva=False, device=CPU, release=vllm_release)
    if not m.spec.confidential_compute:
        assert "is_confidential_compute" not in Path(m.buffer_utils.__file__).read_text()
        return
    log = m.buffer_utils.logger
    monkeypatch.setattr(log, "_once", set())
    with caplog.at_level(logging.INFO):
        m.buffer_utils.NonUvaBuffer(4, torch.int32)
        assert not any("Confidential Computing" in r.getMessage() for r in caplog.records)
        monkeypatch.setattr(V, "CONFIDENTIAL_COMPUTE", True)
        m.buffer_utils.NonUvaBuffer(4, torch.int32)
    said = [r.getMessage() for r in caplog.records if "Confidential Computing" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        f"vLLM {vllm_release}: NVIDIA Confidential Computing detected"
    )
    with V.as_installed(CPU, release=vllm_release):  # vLLM's module, as stagebuf's plugin imports it
        import importlib

        cc = importlib.import_module("vllm.v1.conf_compute_utils")
        before = len(V.INPLACE_H2D_TARGETS)
        t = torch.zeros(2)
        cc.register_inplace_h2d_target(t)
        assert len(V.INPLACE_H2D_TARGETS) == before + 1 and V.INPLACE_H2D_TARGETS[-1]() is t
    assert "vllm.v1.conf_compute_utils" not in sys.modules
