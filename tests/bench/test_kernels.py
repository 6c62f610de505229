"""``python -m benchmarks.kernels``: each side's writer writes what its step stages (so every kernel times
the same work), and a cell reports each kernel and the one ``auto`` ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from benchmarks import kernels
from benchmarks.harness import stagebuf_tier


@pytest.mark.parametrize(("targets", "edits", "length"), [(1, 16, 8), (2, 64, 1), (4, 30, 3)])
def test_a_sides_writer_applies_every_edit_its_step_stages(targets: int, edits: int, length: int) -> None:
    dev = torch.device("cpu")
    with stagebuf_tier("pageable"):
        stage, apply, ts, w = kernels.writer(dev, targets, edits, length, "scatter")
        assert type(w).__name__ == ("StagedWriteTensor" if targets == 1 else "FusedStagedWriter")
        before = [t.gpu.clone() for t in ts]
        stage(3)
        assert sum(t.num_staged for t in ts) == edits
        apply(3)
        changed = [(t.gpu != b).any(dim=1) for t, b in zip(ts, before)]
        assert sum(int(c.sum()) for c in changed) == edits  # one row an edit, none twice
        for t, c in zip(ts, changed):
            rows = t.gpu[c][:, :length].numpy()
            assert (rows == rows[0]).all() and rows.shape[1] == length  # the step's one value list
            assert (t.gpu[c][:, length:] == 0).all()


def test_a_cell_times_every_kernel_and_names_the_one_auto_ran() -> None:
    with stagebuf_tier("pageable"):
        got = kernels.cell(torch.device("cpu"), 2, 16, 2, steps=3)
    assert set(got["us"]) == set(kernels.KERNELS)
    assert all(np.isfinite(v) and v > 0 for v in got["us"].values())
    assert got["auto_ran"] == "scatter"  # no Triton on a CPU device without the interpreter
