"""Every cache in stagebuf is a ``BoundedCache``: it holds at most its cap, keeps what was put last, and no
module sizes a dict by hand."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from stagebuf._common.cache import BoundedCache

SRC = Path(__file__).resolve().parents[2] / "src" / "stagebuf"


@given(cap=st.integers(1, 8), keys=st.lists(st.integers(0, 12), max_size=60))
def test_a_cache_holds_at_most_its_cap_and_the_last_put(cap: int, keys: list[int]) -> None:
    cache: BoundedCache[int, int] = BoundedCache(cap)
    model: dict[int, int] = {}  # the rule: a put into a full cache empties it first
    for i, k in enumerate(keys):
        if k not in cache:
            if len(model) >= cap:
                model.clear()
            model[k] = i
            assert cache.put(k, i) == i
        assert len(cache) <= cap and cache[k] == model[k]
    assert dict(cache) == model


def test_no_module_caps_a_dict_by_hand() -> None:
    """A ``len(x) >= N`` followed by ``x.clear()`` outside the helper is a second size rule."""
    hand = re.compile(r"if len\((?P<name>[\w.\[\]]+)\) >= [\w.]+:\s*\n\s*(?P=name)\.clear\(\)")
    found = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p.name != "cache.py" and hand.search(p.read_text())
    ]
    assert found == []
