"""Views at 8, 16 and 64 ranks: identical ranks share a row, the rest is summarised, figures stay small.

Synthetic frames, built by the real probe on small CPU tensors: rank 0 holds the right
tensors, ranks 1..N-1 hold the same garbage (rank 0's fp32 inv_freq bytes read as bf16,
never-written poison elsewhere), as in the incident where ranks 1-15 agreed on the same
wrong bytes; one odd rank holds zeros instead.
"""

from __future__ import annotations

import pandas as pd
import pytest

from workbench import viz
from workbench.analysis import rankgroups
from workbench.analysis.synthetic import incident_step


def synthetic_step(n_ranks: int, n_tensors: int = 12, odd: int | None = 3, step: str = "wrap_fsdp1") -> pd.DataFrame:
    """One step's probe table: rank 0 right, ranks 1.. identical garbage, rank ``odd`` zeros."""
    return incident_step(n_ranks, n_tensors, step=step, index=2, odd=odd)


def two_steps(n_ranks: int, n_tensors: int = 12) -> pd.DataFrame:
    a = synthetic_step(n_ranks, n_tensors, step="cast").assign(step_index=1)
    return pd.concat([a, synthetic_step(n_ranks, n_tensors)], ignore_index=True)


# -- rank groups --------------------------------------------------------------------
def test_rank_label_and_ranges():
    assert rankgroups.rank_label([5]) == "rank 5"
    assert rankgroups.rank_label(range(1, 16)) == "ranks 1-15 (15 identical)"
    assert rankgroups.rank_ranges([1, 2, 4, 5, 6, 9]) == "1-2,4-6,9"
    assert rankgroups.rank_label([8, 9, 10], how="mixed") == "ranks 8-10 (3, mixed)"
    with pytest.raises(ValueError, match="at least one rank"):
        rankgroups.rank_label([])


@pytest.mark.parametrize("n", [8, 16, 64])
def test_identical_garbage_is_one_group(n):
    groups = rankgroups.group_identical_ranks(synthetic_step(n))
    assert [g for g in groups["ranks"]] == [[0], [1, 2, *range(4, n)], [3]]
    assert list(groups["label"]) == ["rank 0", f"ranks 1-2,4-{n - 1} ({n - 2} identical)", "rank 3"]
    assert set(groups["how"]) == {"identical"}


def test_all_ranks_agree_is_one_row():
    df = synthetic_step(8)
    fixed = pd.concat([df[df["rank"] == 0].assign(rank=r) for r in range(8)], ignore_index=True)
    groups = rankgroups.group_identical_ranks(fixed)
    assert list(groups["label"]) == ["ranks 0-7 (8 identical)"]


def test_distinct_ranks_are_summarised_past_the_row_budget():
    """Every rank a different shard: identical groups would be 64 rows; same-status folds them."""
    df = synthetic_step(64)
    df.loc[df["rank"] > 0, "fingerprint"] = [f"{i:016x}" for i in range(int((df["rank"] > 0).sum()))]
    groups = rankgroups.group_identical_ranks(df, max_rows=6)
    assert len(groups) <= 6
    assert sorted(r for g in groups["ranks"] for r in g) == list(range(64))
    assert "same status" in set(groups["how"])
    # a row budget smaller than the status patterns: the rest becomes one 'mixed' row
    for r in range(4, 12):
        df.loc[(df["rank"] == r) & (df["name"] == f"model.layers.{r}.weight"), "nan"] = 0
        df.loc[(df["rank"] == r) & (df["name"] == f"model.layers.{r}.weight"), "poisoned"] = 0
    groups = rankgroups.group_identical_ranks(df, max_rows=4)
    assert len(groups) == 4 and groups["how"].iloc[-1] == "mixed"
    assert groups["label"].iloc[-1].endswith("mixed)")
    assert sorted(r for g in groups["ranks"] for r in g) == list(range(64))


def test_bad_input_gets_one_clear_error():
    with pytest.raises(ValueError, match="per step"):
        rankgroups.group_identical_ranks(two_steps(8))
    with pytest.raises(ValueError, match="needs columns"):
        rankgroups.group_identical_ranks(pd.DataFrame({"rank": [0]}))
    with pytest.raises(ValueError, match="max_rows"):
        rankgroups.group_identical_ranks(synthetic_step(8), max_rows=1)


# -- figures ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [8, 16, 64])
def test_status_matrix_groups_identical_ranks(n):
    fig = viz.status_matrix(synthetic_step(n))
    heat = fig.data[0]
    assert list(heat.y) == ["rank 0", f"ranks 1-2,4-{n - 1} ({n - 2} identical)", "rank 3"]
    assert len(heat.z) == 3 and len(heat.z[0]) == 12
    assert f"{n} ranks in 3 rows" in fig.layout.title.text
    # hover: the group's label, the status and why, the dtype and the first values
    cell = heat.text[1][0]
    assert cell.startswith(f"ranks 1-2,4-{n - 1}") and "dtype: bfloat16 here, float32 on rank 0" in cell
    assert "poison" in heat.text[1][1] and "never written" in heat.text[1][1]
    assert "differs" in heat.text[2][1]


def test_small_worlds_keep_one_row_per_rank():
    heat = viz.status_matrix(synthetic_step(4, odd=None)).data[0]
    assert list(heat.y) == ["rank 0", "rank 1", "rank 2", "rank 3"]
    heat = viz.status_matrix(synthetic_step(8), group=False).data[0]
    assert len(heat.y) == 8


def test_64_ranks_by_60_tensors_stays_small():
    df = synthetic_step(64, n_tensors=60)
    fig = viz.status_matrix(df)
    assert len(fig.data[0].y) == 3
    assert len(fig.to_json()) < 2_000_000
    # worst case: nothing identical, every rank its own content -> summarised, still small
    df.loc[df["rank"] > 0, "fingerprint"] = [f"{i:016x}" for i in range(int((df["rank"] > 0).sum()))]
    fig = viz.status_matrix(df)
    assert len(fig.data[0].y) <= 16
    assert len(fig.to_json()) < 2_000_000


def test_comparison_groups_both_panels():
    bug = two_steps(16)
    fixed = pd.concat([bug[bug["rank"] == 0].assign(rank=r) for r in range(16)], ignore_index=True)
    fig = viz.comparison(bug, fixed, "cast-params-only")
    assert list(fig.data[0].y) == ["rank 0", "ranks 1-2,4-15 (14 identical)", "rank 3"]
    assert list(fig.data[1].y) == ["ranks 0-15 (16 identical)"]


@pytest.mark.parametrize("n", [8, 64])
def test_buffer_values_draws_identical_ranks_once(n):
    fig = viz.buffer_values(two_steps(n), "model.rotary_emb.inv_freq")
    names = [t.name for t in fig.data]
    assert names == ["rank 0", f"ranks 1-2,4-{n - 1} ({n - 2} identical)", "rank 3"] * 2
    assert sum(t.showlegend for t in fig.data) == 3
    assert f"ranks 1-2,4-{n - 1}" in fig.data[1].hovertemplate
    assert len(fig.to_json()) < 200_000


def test_buffer_values_folds_lines_past_the_budget():
    df = synthetic_step(16)
    inv = df["name"] == "model.rotary_emb.inv_freq"
    for r in range(4, 16):  # twelve ranks, twelve different contents
        sel = inv & (df["rank"] == r)
        df.loc[sel, "fingerprint"] = f"{r:016x}"
        df.loc[sel, "head"] = pd.Series([[float(r)] * 8], index=df.index[sel])
    fig = viz.buffer_values(df, "model.rotary_emb.inv_freq", max_lines=5)
    assert len(fig.data) == 5
    last = fig.data[-1]
    assert last.name == "ranks 5-15 (11, 11 distinct)"
    assert {row[0] for row in last.customdata if row[1]} == {f"rank {r}" for r in range(5, 16)}
