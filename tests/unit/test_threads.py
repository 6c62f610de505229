"""The thread contract: a stateful object belongs to one thread at a time. Check mode binds it to the first
thread that uses it and refuses another, naming both; ``release_thread()`` hands it over. The free functions
are safe from any thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import stagebuf


def in_thread(fn: Callable[[], Any], name: str = "other") -> Any:
    """``fn()`` on a new thread named ``name``: its result, or the exception it raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # handed back to the test
            out.append(e)

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    return out[0]


def _stage(st: stagebuf.StepStager) -> Any:
    with st.step() as s:
        return s.stage([1, 2])


def _write(w: stagebuf.StagedWriteTensor) -> None:
    w.stage_write(0, 0, [5])
    w.apply_write()


def _fused(pair: tuple[stagebuf.FusedStagedWriter, stagebuf.StagedWriteTensor]) -> None:
    f, w = pair
    w.stage_write(0, 0, [6])
    f.apply([w])


def _table(t: stagebuf.DeviceParamTable) -> None:
    t["x"].np[0] += 1
    t.sync()


OBJECTS: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "UvaBufferPool": (lambda: stagebuf.UvaBufferPool(4, torch.int32), lambda p: p.copy_to_uva([1, 2])),
    "UvaBackedTensor": (lambda: stagebuf.UvaBackedTensor(4, torch.int32), lambda b: b.copy_to_uva()),
    "StepStager": (stagebuf.StepStager, _stage),
    "DeviceParamTable": (lambda: stagebuf.DeviceParamTable(2, {"x": torch.int32}), _table),
    "StagedWriteTensor": (lambda: stagebuf.StagedWriteTensor((2, 2), torch.int32), _write),
    "FusedStagedWriter": (
        lambda: (stagebuf.FusedStagedWriter(), stagebuf.StagedWriteTensor((2, 2), torch.int32)),
        _fused,
    ),
}


def owner_of(obj: Any) -> Any:
    return obj[0] if isinstance(obj, tuple) else obj


def release(obj: Any) -> None:
    for o in obj if isinstance(obj, tuple) else (obj,):
        o.release_thread()


@pytest.mark.parametrize("cls", OBJECTS)
def test_check_mode_refuses_a_second_thread_until_released(
    cls: str, cpu_tier: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGEBUF_CHECK", "1")
    make, use = OBJECTS[cls]
    obj = in_thread(make, "maker")  # made on one thread: the first to use it owns it
    use(obj)
    err = in_thread(lambda: use(obj), "intruder")
    assert isinstance(err, stagebuf.UsageError), err
    text = str(err)
    assert "'MainThread'" in text and "'intruder'" in text and "release_thread()" in text
    # only the owner hands it over
    assert isinstance(in_thread(lambda: owner_of(obj).release_thread(), "intruder"), stagebuf.UsageError)
    release(obj)
    err = in_thread(lambda: use(obj), "heir")  # the next thread to use it takes it
    assert not isinstance(err, BaseException), err
    with pytest.raises(stagebuf.UsageError, match="'heir'"):
        use(obj)  # the main thread gave it away


@pytest.mark.parametrize("cls", OBJECTS)
def test_plain_mode_binds_nothing(cls: str, cpu_tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STAGEBUF_CHECK", raising=False)
    make, use = OBJECTS[cls]
    obj = make()
    use(obj)
    err = in_thread(lambda: use(obj), "next")  # one thread at a time: allowed, whichever it is
    assert not isinstance(err, BaseException), err
    release(obj)  # nothing to hand over


def test_a_step_open_on_another_thread_is_named(cpu_tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STAGEBUF_CHECK", raising=False)
    st = stagebuf.StepStager()
    step = st.step()
    err = in_thread(st.step, "intruder")
    assert isinstance(err, stagebuf.UsageError)
    assert "still open on thread 'MainThread'" in str(err) and "'intruder'" in str(err)
    with pytest.raises(stagebuf.UsageError, match=r"step 0 is still open; flush it before step\(\)"):
        st.step()  # the same thread: the plain message
    step.flush()
    st.step().flush()


def test_free_functions_from_many_threads(cpu_tier: Any) -> None:
    """async_copy_to_gpu and make_buffer share nothing between calls: every thread gets its own values."""
    n = 8
    results: dict[int, list[np.ndarray]] = {}

    def work(k: int) -> None:
        got = []
        for i in range(50):
            want = np.arange(16, dtype=np.int64) * (k * 1000 + i)
            got.append((want, stagebuf.async_copy_to_gpu(want).cpu().numpy()))
            b = stagebuf.make_buffer(16, torch.int64)
            b.np[:] = want
            got.append((want, b.np.copy()))
        results[k] = got

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == n
    for got in results.values():
        for want, have in got:
            np.testing.assert_array_equal(have, want)
