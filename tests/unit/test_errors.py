"""One exception base: everything stagebuf raises for its own conditions is a StagebufError,
and keeps the builtin parent that ``except`` clauses written before it expect.

That nothing else escapes a misuse of a public object is checked by behaviour, in
``test_misuse.py`` (it replaced a scan of the source for ``raise Name(...)``, which missed
``buf.device = x`` raising a bare AttributeError from a helper).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import stagebuf
from stagebuf import (
    DeviceParamTable,
    StagebufError,
    StagedWriteTensor,
    StepStager,
    UvaBufferPool,
)


def test_every_exported_exception_has_the_base():
    classes = [getattr(stagebuf, n) for n in stagebuf.__all__]
    errors = [c for c in classes if isinstance(c, type) and issubclass(c, BaseException)]
    assert len(errors) >= 14
    for c in errors:
        assert issubclass(c, StagebufError), c
        builtin = {ValueError, TypeError, RuntimeError, AttributeError, KeyError}
        assert c is StagebufError or c is stagebuf.SetupError or builtin & set(c.__mro__), c


MISUSES = [
    pytest.param(lambda: UvaBufferPool(-1, torch.int32), ValueError, id="pool-size-negative"),
    pytest.param(lambda: UvaBufferPool(4, "no-such-dtype"), TypeError, id="pool-bad-dtype"),
    pytest.param(lambda: StagedWriteTensor((4, 4), torch.int8), ValueError, id="sw-dtype"),
    pytest.param(lambda: StepStager(capacity=0), ValueError, id="stager-capacity"),
    pytest.param(lambda: DeviceParamTable(2, {"a": torch.int32}, "cpu")["b"], KeyError, id="table-field"),
]


@pytest.mark.parametrize(("call", "builtin"), MISUSES)
def test_misuse_raises_the_base_and_the_builtin(cpu_tier, call, builtin):
    with pytest.raises(StagebufError) as ei:
        call()
    assert isinstance(ei.value, builtin)


def test_order_and_attribute_misuse(cpu_tier):
    stager = StepStager()
    st = stager.step()
    with pytest.raises(StagebufError) as ei:
        stager.step()  # the step before is still open
    assert isinstance(ei.value, RuntimeError) and "still open" in str(ei.value)
    st.flush()
    with pytest.raises(StagebufError) as ei:
        st.stage(np.arange(3))  # a flushed step
    assert isinstance(ei.value, RuntimeError)
    with pytest.raises(StagebufError) as ei:
        stager.device = torch.device("cpu")  # looks writable, would be ignored
    assert isinstance(ei.value, AttributeError)


def test_buffer_attributes_refuse_writes_with_the_base_error(cpu_tier) -> None:
    """buf.device = x raises ReadOnlyAttributeError (a StagebufError), not a bare AttributeError."""
    buf = stagebuf.make_buffer(4, torch.int32)
    for name, value in (("device", torch.device("cpu")), ("tier", stagebuf.Tier.HOST), ("shape", (8,))):
        with pytest.raises(stagebuf.ReadOnlyAttributeError, match=f"{name} is read-only") as e:
            setattr(buf, name, value)
        assert isinstance(e.value, stagebuf.StagebufError) and isinstance(e.value, AttributeError)
    with pytest.raises(stagebuf.ReadOnlyAttributeError, match="cannot be deleted"):
        del buf.dev


def test_an_unknown_field_raises_the_same_error_both_ways(cpu_tier) -> None:
    table = stagebuf.DeviceParamTable(4, {"top_k": torch.int32})
    for get in (lambda: table["topk"], lambda: table.fields["topk"]):
        with pytest.raises(stagebuf.UnknownFieldError, match="no field 'topk'; fields: top_k") as e:
            get()
        assert isinstance(e.value, KeyError)
    assert table.fields["top_k"] is table["top_k"] and list(table.fields) == ["top_k"]
    assert len(table.fields) == 1 and "top_k" in table.fields
