"""The client's fast table paths give exactly what the pandas calls they replace give (issue 49's speed work):
a frame's tables built with Int64 count columns, and the rows ``status`` walks."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from workbench.analysis import findings
from workbench.analysis.frames import COLUMNS, INT_COLUMNS, table

ROWS = [
    {"rank": 0, "name": "model.w", "numel": 6, "nan": 0, "inf": None, "poisoned": np.int64(2), "dtype": "bfloat16",
     "mean": 0.5, "is_meta": False, "head": [1.0, 2.0], "agree": "0,1", "extra": "kept"},
    {"rank": 1, "name": "model.inv_freq", "numel": np.nan, "nan": 3, "inf": 0, "poisoned": 0, "dtype": None,
     "mean": float("nan"), "is_meta": True, "head": [], "agree": None},
    {"rank": 1, "name": "model.b", "numel": 2.0},
]


def _astype_table(rows, columns):
    """What ``table`` built before: object columns, then ``astype`` to Int64."""
    seen = dict.fromkeys(columns)
    for r in rows:
        seen.update(dict.fromkeys(r))
    df = pd.DataFrame({c: [r.get(c) for r in rows] for c in seen}, columns=list(seen))
    return df.astype({c: "Int64" for c in INT_COLUMNS if c in df.columns})


def test_table_is_the_astype_frame():
    for rows in (ROWS, ROWS[:1], ROWS[2:], []):
        got, want = table(rows, COLUMNS), _astype_table(rows, COLUMNS)
        pd.testing.assert_frame_equal(got, want, check_exact=True)
        assert list(got.dtypes) == list(want.dtypes)
    assert str(table(ROWS, COLUMNS)["numel"].dtype) == "Int64"


def _same(u, v) -> bool:
    if isinstance(u, float) and math.isnan(u):
        return type(u) is type(v) and math.isnan(v)
    return type(u) is type(v) and (u is v or bool(np.all(u == v)))


def test_status_rows_are_itertuples():
    df = table(ROWS, COLUMNS)
    assert any(type(df[c].array).__name__ == "ArrowStringArray" for c in df.columns)  # the fast path runs here
    for cols in (tuple(df.columns), findings._STATUS_COLUMNS, ("name", "missing", "rank")):
        want = list(df[[c for c in cols if c in df.columns]].itertuples(index=False))
        got = list(findings._rows(df, cols))
        assert [r._fields for r in got] == [r._fields for r in want]
        assert all(_same(u, v) for g, w in zip(got, want, strict=True) for u, v in zip(g, w, strict=True))
