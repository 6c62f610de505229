"""The caller's default device changes nothing: every host allocation says ``device="cpu"``.

Engines set a default device (nano-vllm's ``ModelRunner`` calls ``torch.set_default_device("cuda")``) and
then call stagebuf. Here the default is the ``meta`` device, where a tensor holds no data: an allocation
that forgot its device lands there, and reading it (``.numpy()``, a copy) fails. Each public class runs a
short stream under ``with torch.device("meta")`` and under ``torch.set_default_device("meta")``, and its
device results equal a numpy model's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import stagebuf

CPU = torch.device("cpu")


@contextmanager
def _block() -> Iterator[None]:
    with torch.device("meta"):
        yield


@contextmanager
def _default() -> Iterator[None]:
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def _pool() -> list[np.ndarray]:
    pool = stagebuf.UvaBufferPool(8, torch.int32, device=CPU)
    out = [pool.copy_to_uva([1, 2, 3]).numpy().copy()]
    out.append(pool.copy_chunks_to_uva([np.array([4, 5], np.int32), [6]], 3).numpy().copy())
    out.append(pool.copy_to_gpu(np.array([7, 8], np.int32)).numpy().copy())
    return out


def _backed() -> list[np.ndarray]:
    t = stagebuf.UvaBackedTensor((4, 2), torch.float32, device=CPU)
    t.np[:] = np.arange(8, dtype=np.float32).reshape(4, 2)
    return [t.copy_to_uva(3).numpy().copy()]


def _staged() -> list[np.ndarray]:
    t = stagebuf.StagedWriteTensor((3, 4), torch.int64, device=CPU)
    t.stage_write(0, 1, [5, 6])
    t.stage_writes(np.array([2]), np.array([0]), np.array([[7, 8]]))
    t.apply_write()
    u = stagebuf.StagedWriteTensor((3, 4), torch.int64, device=CPU)
    u.stage_write_elem(1, 9)
    stagebuf.FusedStagedWriter(device=CPU).apply([t, u])
    return [t.gpu.numpy().copy(), u.gpu.numpy().copy()]


def _stager() -> list[np.ndarray]:
    stager = stagebuf.StepStager(device=CPU)
    with stager.step() as step:
        a = step.stage(np.array([3, 1, 2], np.int32))
        b = step.stage([1.5, 2.5])
    return [a.numpy().copy(), b.numpy().copy()]


def _table() -> list[np.ndarray]:
    params = stagebuf.DeviceParamTable(4, {"temperature": torch.float32, "top_k": torch.int32}, device=CPU)
    params["top_k"].np[:] = [1, 2, 3, 4]
    params["temperature"].np[:] = [0.5, 1.0, 1.5, 2.0]
    assert params.sync()
    return [params["top_k"].gpu.numpy().copy(), params["temperature"].gpu.numpy().copy()]


def _copy() -> list[np.ndarray]:
    return [stagebuf.async_copy_to_gpu(np.array([4, 5, 6], np.int64), device=CPU).numpy().copy()]


def _buffers() -> list[np.ndarray]:
    out = []
    for make in (stagebuf.NonUvaBuffer, stagebuf.HostBuffer):
        b = make(4, torch.int32, device=CPU)
        b.np[:] = [1, 2, 3, 4]
        out.append(b.uva(2).numpy().copy())
    return out


CASES: dict[str, tuple[Callable[[], list[np.ndarray]], list[np.ndarray]]] = {
    "UvaBufferPool": (_pool, [np.array([1, 2, 3]), np.array([4, 5, 6]), np.array([7, 8])]),
    "UvaBackedTensor": (_backed, [np.arange(6, dtype=np.float32).reshape(3, 2)]),
    "StagedWriteTensor+FusedStagedWriter": (
        _staged,
        [
            np.array([[0, 5, 6, 0], [0, 0, 0, 0], [7, 8, 0, 0]]),
            np.array([[0, 0, 0, 0], [9, 0, 0, 0], [0, 0, 0, 0]]),
        ],
    ),
    "StepStager": (_stager, [np.array([3, 1, 2]), np.array([1.5, 2.5])]),
    "DeviceParamTable": (_table, [np.array([1, 2, 3, 4]), np.array([0.5, 1.0, 1.5, 2.0])]),
    "async_copy_to_gpu": (_copy, [np.array([4, 5, 6])]),
    "NonUvaBuffer+HostBuffer": (_buffers, [np.array([1, 2]), np.array([1, 2])]),
}


@pytest.mark.parametrize("how", [_block, _default], ids=["with-torch.device", "set_default_device"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_default_device_changes_nothing(case: str, how: Callable[[], contextmanager[None]]) -> None:
    run, want = CASES[case]
    stagebuf.reset_capabilities()
    with how():
        got = run()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
