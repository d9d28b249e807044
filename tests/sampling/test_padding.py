"""Left and right padding (jaxrl_llm/sampling/padding.py): every row comes back from its mask, in place, with the
fill everywhere else; a row that does not fit is refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_llm.sampling.padding import left_pad, right_pad

pytestmark = pytest.mark.quick

ROWS = st.lists(st.lists(st.integers(1, 1000), max_size=9), min_size=1, max_size=6)


@given(rows=ROWS, extra=st.integers(0, 3))
def test_left_pad_right_aligns_each_row(rows, extra):
    length = max(map(len, rows)) + extra
    tokens, mask = left_pad(rows, length, pad_id=-1)
    assert tokens.shape == mask.shape == (len(rows), length) and tokens.dtype == mask.dtype == np.int32
    for row, t, m in zip(rows, tokens, mask, strict=True):
        assert m.tolist() == [0] * (length - len(row)) + [1] * len(row)
        assert t[m == 1].tolist() == row and (t[m == 0] == -1).all()


@given(rows=ROWS, extra=st.integers(0, 3))
def test_right_pad_left_aligns_each_row(rows, extra):
    length = max(map(len, rows)) + extra
    tokens, mask = right_pad(rows, length, fill=-1)
    for row, t, m in zip(rows, tokens, mask, strict=True):
        assert m.tolist() == [1] * len(row) + [0] * (length - len(row))
        assert t[: len(row)].tolist() == row and (t[len(row):] == -1).all()
    values, _ = right_pad([[0.5, -2.25], [1.0]], 3, dtype=np.float32)
    assert values.dtype == np.float32 and values.tolist() == [[0.5, -2.25, 0.0], [1.0, 0.0, 0.0]]


def test_a_row_too_long_is_refused():
    with pytest.raises(ValueError, match="sequence of 3 tokens does not fit length 2"):
        left_pad([[1, 2, 3]], 2, 0)
    with pytest.raises(ValueError, match="row of 3 values does not fit length 2"):
        right_pad([[1, 2, 3]], 2)
