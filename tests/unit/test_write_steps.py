"""A staged-write apply's three steps (log, check, launch) and the seams around them.

The check hands the launch one ``WriteBatch`` per target in vLLM's terms (``indices``, ``starts``,
``cu_lens``); read the way vLLM's kernel reads them, the batch must write what a numpy model of the
staged edits holds, in staging order. A writer's ``launcher_class`` is its launch step: a subclass
that writes each batch that way (in numpy) must leave every target as the built-in launch does. The
Triton kernel's rows (``edit_meta``) are checked against the same model by a numpy twin of the kernel.
The step modules compare no tiers and import no private names of one another.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import read_back
from stagebuf import FusedStagedWriter, StagedWriteTensor
from stagebuf._rings.staged_write import launcher as sw
from stagebuf._tiers.settings import Kernel

SRC = Path(sw.__file__).resolve().parents[2]
NP = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}
Edit = tuple[int, int, list[int]]


def examples(n: int) -> settings:
    return settings(
        max_examples=n, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )


def vllm_reads(batch: sw.WriteBatch, out: np.ndarray) -> None:
    """Write ``batch`` into the 2-D ``out`` as vLLM's staged-write kernel reads its arguments."""
    for k in range(batch.indices.shape[0]):
        begin = 0 if k == 0 else int(batch.cu_lens[k - 1])
        end = int(batch.cu_lens[k])
        row, start = int(batch.indices[k]), int(batch.starts[k])
        out[row, start : start + end - begin] = batch.values[begin:end]


@st.composite
def staged(draw: st.DrawFn) -> tuple[tuple[int, int], list[tuple[str, list[Edit]]]]:
    """A target shape and calls staging edits: lists one by one, or arrays in one ``stage_writes``."""
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    calls = []
    for _ in range(draw(st.integers(1, 4))):
        edits = []
        for _ in range(draw(st.integers(1, 40))):
            start = draw(st.integers(0, cols - 1))
            n = draw(st.integers(1, cols - start))
            edits.append(
                (
                    draw(st.integers(0, rows - 1)),
                    start,
                    draw(st.lists(st.integers(-99, 99), min_size=n, max_size=n)),
                )
            )
        calls.append((draw(st.sampled_from(["lists", "arrays"])), edits))
    return (rows, cols), calls


def stage(t: StagedWriteTensor, calls: list[tuple[str, list[Edit]]]) -> np.ndarray:
    """Stage ``calls`` on ``t``; the numpy model of ``t`` once they are applied (later edits win)."""
    model = np.zeros((t.rows, t.cols), NP[t.dtype])
    for how, edits in calls:
        if how == "lists":
            for r, s, v in edits:
                t.stage_write(r, s, v)
        else:
            lens = np.array([len(v) for _, _, v in edits])
            flat = np.array([x for _, _, v in edits for x in v], NP[t.dtype])
            t.stage_writes(np.array([e[0] for e in edits]), np.array([e[1] for e in edits]), flat, lens)
        for r, s, v in edits:
            model[r, s : s + len(v)] = v
    return model


@examples(60)
@given(case=staged())
def test_the_check_hands_the_launch_vllms_batch(case) -> None:
    shape, calls = case
    t = StagedWriteTensor(shape, torch.int32, "cpu")
    model = stage(t, calls)
    batch = sw.check(t._log, t._target, t)
    assert batch is not None
    e = batch.indices.shape[0]
    assert all(a.dtype == np.int64 and a.shape == (e,) for a in (batch.indices, batch.starts, batch.cu_lens))
    np.testing.assert_array_equal(batch.cu_lens, np.cumsum(batch.lens))
    assert batch.values.shape[0] == (batch.cu_lens[-1] if e else 0) and batch.values.dtype == np.int32
    got = np.zeros(shape, np.int32)
    vllm_reads(batch, got)
    np.testing.assert_array_equal(got, model)
    # the edits of a batch write distinct elements (overlaps resolved, each element's last value)
    flat = [
        r * shape[1] + s + j for r, s, n in zip(batch.indices, batch.starts, batch.lens) for j in range(n)
    ]
    assert len(flat) == len(set(flat))
    assert t.num_staged == sum(len(edits) for _, edits in calls)  # the check changes nothing


def test_a_list_of_one_bad_value_fails_the_check_and_names_it() -> None:
    t = StagedWriteTensor((4, 4), torch.int32, "cpu")
    t.stage_write(1, 2, [5, 6])
    t.stage_write(3, 0, [2**31])
    with pytest.raises(Exception, match=r"staged edit 1 \(stage_write\(index=3, start=0, 1 values\)\)"):
        sw.check(t._log, t._target, t)
    assert t.pending_writes() == [(1, 2, [5, 6]), (3, 0, [2**31])]


class VllmLauncher(sw.Launcher):
    """A launch step that writes each batch as vLLM's kernel reads it (the targets are CPU tensors)."""

    def launch(self, batches: Sequence[sw.WriteBatch]) -> Kernel:
        for b in batches:
            out = b.target.flat.numpy().reshape(-1, b.target.stride)
            vllm_reads(b, out)
        return "host"


class VllmTensor(StagedWriteTensor):
    launcher_class = VllmLauncher


class VllmWriter(FusedStagedWriter):
    launcher_class = VllmLauncher


@examples(25)
@given(case=staged(), other=staged())
def test_a_launcher_class_takes_every_apply(cpu_tier, case, other) -> None:
    """The built-in launch and a vLLM-reading launcher class leave the same targets, single and fused."""
    (shape, calls), (shape2, calls2) = case, other
    mine, theirs = StagedWriteTensor(shape, torch.int32), VllmTensor(shape, torch.int32)
    model = stage(mine, calls)
    stage(theirs, calls)
    mine.apply_write()
    theirs.apply_write()
    np.testing.assert_array_equal(read_back(mine.gpu), model)
    np.testing.assert_array_equal(read_back(theirs.gpu), model)
    assert theirs.kernel == "host" and theirs.num_staged == 0 and theirs.stats()["steps"] == 0
    pairs = [(StagedWriteTensor(s, torch.int32), VllmTensor(s, torch.int32)) for s in (shape, shape2)]
    models = [stage(a, c) for (a, _), c in zip(pairs, (calls, calls2))]
    for (_, b), c in zip(pairs, (calls, calls2)):
        stage(b, c)
    FusedStagedWriter().apply([a for a, _ in pairs])
    VllmWriter().apply([b for _, b in pairs])
    for (a, b), m in zip(pairs, models):
        np.testing.assert_array_equal(read_back(a.gpu), m)
        np.testing.assert_array_equal(read_back(b.gpu), m)


def kernel_twin(meta: np.ndarray, values: np.ndarray, flats: dict[int, np.ndarray]) -> None:
    """The Triton kernel in numpy: row ``(address, first element, length, source)`` per edit."""
    for ptr, dst, n, src in meta.tolist():
        flats[ptr][dst : dst + n] = values[src : src + n]


@examples(40)
@given(cases=st.lists(staged(), min_size=1, max_size=3))
def test_the_triton_rows_write_the_batches(cases) -> None:
    """``edit_meta`` of one target or several (its rows in Python up to PY_ROWS edits, else numpy)."""
    ts = [StagedWriteTensor(shape, torch.int64, "cpu") for shape, _ in cases]
    models = [stage(t, calls) for t, (_, calls) in zip(ts, cases)]
    batches = [sw.check(t._log, t._target, t) for t in ts]
    meta, values, longest = sw.edit_meta([b for b in batches if b is not None])
    assert meta.shape == (sum(b.indices.shape[0] for b in batches if b is not None), 4)
    assert longest == meta[:, 2].max()
    flats = {t._target.ptr: t.gpu.numpy().reshape(-1) for t in ts}
    kernel_twin(meta, values, flats)
    for t, m in zip(ts, models):
        np.testing.assert_array_equal(t.gpu.numpy().reshape(m.shape), m)


# --- what the step modules may not do ---------------------------------------------------------

STEP_FILES = [
    *sorted((SRC / "_rings" / "staged_write").glob("*.py")),
    SRC / "_engines" / "vllm_step.py",
    SRC / "_engines" / "vllm_step_batch.py",
]


def tier_branches(tree: ast.AST) -> list[str]:
    """``Tier.<member>`` reads and ``<x>.tier.copies``/``async_host_reads`` flag reads in ``tree`` (a
    tier's name in a message is no branch)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Tier":
            out.append(f"Tier.{node.attr} (line {node.lineno})")
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "tier"
            and node.attr in ("copies", "async_host_reads")
        ):
            out.append(f".tier.{node.attr} (line {node.lineno})")
    return out


def private_imports(tree: ast.AST) -> list[str]:
    return [
        f"{node.module}.{a.name} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level
        for a in node.names
        if a.name.startswith("_")
    ]


@pytest.mark.parametrize("path", STEP_FILES, ids=lambda p: p.name)
def test_the_step_modules_ask_buffers_not_tiers_and_import_public_names(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert tier_branches(tree) == [] and private_imports(tree) == []


def test_the_checks_can_fail() -> None:
    tree = ast.parse("from .launcher import _Launcher\nif t is Tier.HOST and buf.tier.copies: pass\n")
    assert private_imports(tree) == ["launcher._Launcher (line 1)"]
    assert sorted(tier_branches(tree)) == [".tier.copies (line 2)", "Tier.HOST (line 2)"]
