"""``workbench diff`` / ``wb.diff``: two captures of a job, where they first part, in one sentence.

Real jobs under real torchrun (gloo, CPU), captured once per module: the headline incident's job at
``--dtypes fp32`` (good) and bf16 (bad), the good one again on "another CPU" (the kernel knobs), and
an FSDP2 job whose own loader is right at 2 ranks and wrong at 4.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jobrun
import plotly.graph_objects as go
import pytest

import workbench as wb
from workbench import cli
from workbench.postmortem import diff as diff_mod

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FIXTURES = ROOT / "fixtures" / "bundles"


def _torchrun(script: str, out: Path, *args: str, ranks: int = 2, env: dict[str, str] | None = None,
              ok: bool = True) -> None:
    e = {k: v for k, v in os.environ.items() if k not in ("WORKBENCH_CAPTURE", "ATEN_CPU_CAPABILITY",
                                                          "ONEDNN_MAX_CPU_ISA")}
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    run = jobrun.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                      str(ranks), str(EXAMPLES / script), str(out), *args], out, timeout=300, env=e, cwd=out.parent)
    assert (run.returncode == 0) == ok, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("diff")
    _torchrun("fsdp1_rotary_job.py", base / "good", "--dtypes", "fp32")
    _torchrun("fsdp1_rotary_job.py", base / "bad", ok=False)  # rank 0 times out in its second bucket's send
    _torchrun("fsdp1_rotary_job.py", base / "elsewhere", "--dtypes", "fp32",
              env={"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    return base


@pytest.fixture(scope="module")
def sizes(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("sizes")
    _torchrun("fsdp2_shards_job.py", base / "ws2", ranks=2)
    _torchrun("fsdp2_shards_job.py", base / "ws4", ranks=4)
    return base


def test_the_headline_job_fp32_against_bf16_names_inv_freq_and_the_bucket(runs):
    d = wb.diff(runs / "good", runs / "bad")
    s = str(d)
    print(s)
    assert s.startswith("good computes in fp32, bad in bf16 (the dtype the runs were given")
    # the first cell: the buffer that did not follow the cast, on rank 0, at the first point
    assert d.first["point"] == "load" and d.first["name"].endswith("rotary_emb.inv_freq")
    assert d.first["kind"] == "dtype" and d.first["ranks"] == [0]
    assert "at `load` `inv_freq`, `original_inv_freq`: stays fp32 in bad" in s
    assert "in bad from `cast` the ranks disagree on its dtype: fp32 on rank 0; bf16 on rank 1" in s
    # the bucket that parted: rank 0's fp32 bucket of 2 tensors (256 B) where good sent all 27 in one
    assert ("the first collective that differs is broadcast #1 at `wrap` (rank 0: fp32 bucket of 27 tensors, "
            "1707776 B in good vs fp32 bucket of 2 tensors, 256 B in bad)") in s
    assert "rank 0 raised RuntimeError at `wrap` in bad only" in s
    # everything the cast was given is said as such, never as a cause
    given = d.cells[d.cells["kind"] == "dtype as given"]
    assert len(given) == 50 and not d.same  # 25 parameters on rank 0 at `load`, on both ranks at `cast`
    assert set(d.cells["kind"]) <= set(diff_mod.KINDS)


def test_the_same_job_at_2_and_4_ranks_names_the_tensor_only_4_shard_wrong(sizes):
    d = wb.diff(sizes / "ws2", sizes / "ws4")
    s = str(d)
    print(s)
    assert s.startswith("the runs' settings differ: ws2 ran on 2 ranks, ws4 on 4")
    assert "the runs agree through `materialize`" in s
    assert d.first["point"] == "load_weights" and d.first["name"] == "model.head.weight"
    assert d.first["kind"] == "values" and d.first["ranks"] == [0, 1, 2, 3]
    assert "at `load_weights` `head.weight`, `head.bias`: sum of squares" in s
    assert "every collective matches in op and dtype (sizes follow the shards)" in s
    # the tensors every world size shards evenly agree across shards (within rounding, or exactly)
    fine = d.cells[(d.cells["point"] == "load_weights") & d.cells["name"].str.contains("up|mid")]
    assert len(fine) == 4 and set(fine["kind"]) <= {"same", "within rounding"}, fine


def test_rows_recorded_before_sumsq_still_compare_across_world_sizes(sizes):
    """A committed bundle's rows lack ``sumsq``: the sum (mean x finite count) and min/max still compare."""
    a, b = wb.load(sizes / "ws2").bug, wb.load(sizes / "ws4").bug
    a.tensors, b.tensors = a.tensors.drop(columns=["sumsq"]), b.tensors.drop(columns=["sumsq"])
    d = wb.diff(a, b, labels=("two", "four"))
    assert d.first["point"] == "load_weights" and d.first["name"] == "model.head.weight", str(d)
    assert "sum of squares" not in str(d)


def test_another_cpu_is_the_same_within_rounding_and_names_the_kernels(runs):
    d = wb.diff(runs / "good", runs / "elsewhere")
    s = str(d)
    print(s)
    assert s.startswith("another machine or kernels: ATEN_CPU_CAPABILITY unset in good, default in elsewhere; "
                        "ONEDNN_MAX_CPU_ISA unset in good, AVX2 in elsewhere")
    assert "the same within rounding at every point" in s and "none beyond rounding" in s
    assert "the kernels changed (ATEN_CPU_CAPABILITY=default, ONEDNN_MAX_CPU_ISA=AVX2 in elsewhere)" in s
    assert d.same and d.first is None and d.collective is None
    assert "within rounding" in set(d.cells["kind"])


def test_unrelated_captures_are_one_line(runs, sizes):
    s = str(wb.diff(runs / "good", sizes / "ws2"))
    assert s == ("good and ws2 share no points (no tensor of the same name at a point of the same name): nothing "
                 "to compare (good: load, cast, wrap, forward; ws2: build, shard, materialize, load_weights, "
                 "forward)")
    bundle = FIXTURES / "weight-sync-rank0-metadata.wbundle"
    s = str(wb.diff(bundle, runs / "good"))
    assert s.startswith("weight-sync-rank0-metadata and good share no points") and "\n" not in s


def test_a_bundle_against_itself_and_a_capture_against_its_merged_bundle(runs, tmp_path):
    bundle = FIXTURES / "fsdp1-rotary-meta-init.wbundle"
    assert str(wb.diff(bundle, bundle)) == "the same bytes at every point"
    merged = wb.bundle.save(wb.load(runs / "bad"), tmp_path / "bad.wbundle")
    d = wb.diff(runs / "good", merged)
    assert d.first["name"].endswith("inv_freq") and "256 B in bad" in str(d)


def test_the_view_outlines_the_first_cell_and_the_cli_writes_the_page(runs, tmp_path, capsys):
    d = wb.diff(runs / "good", runs / "bad")
    fig = d.view()
    assert isinstance(fig, go.Figure)
    heat = fig.data[0]
    assert tuple(heat.y)[:1] == ("load",) and len(heat.x) == d.cells["name"].nunique()
    rect = fig.layout.shapes[0]
    col = list(dict.fromkeys(d.cells["name"])).index(d.first["name"])
    assert list(heat.x)[col].endswith("rotary_emb.inv_freq")
    assert (rect.x0, rect.x1, rect.y0, rect.y1) == (col - 0.5, col + 0.5, -0.5, 0.5)
    out = tmp_path / "diff.html"
    rc = cli.main(["diff", str(runs / "good"), str(runs / "bad"), "-o", str(out)])
    printed = capsys.readouterr().out
    assert rc == 1 and printed.startswith(str(d)) and f"report: {out}" in printed
    page = out.read_text()
    assert "stays fp32 in bad" in page and "plotly" in page
    assert cli.main(["diff", str(runs / "good"), str(runs / "elsewhere")]) == 0
    assert cli.main(["diff", str(runs / "good"), str(tmp_path / "nothing")]) == 2
    assert "workbench: error:" in capsys.readouterr().err


def test_a_fix_against_its_bug_path_from_one_recorded_bundle():
    """``BUNDLE@FIX`` (no jobs to run): the catalogue's headline fix agrees through `load` and parts at `cast`."""
    bundle = FIXTURES / "fsdp1-rotary-meta-init.wbundle"
    d = wb.diff(f"{bundle}@cast-params-only", bundle, labels=("fix", "bug"))
    s = str(d)
    assert s.startswith("the runs agree through `load`; at `cast` `inv_freq`, `original_inv_freq`: fp32 in fix, "
                        "bf16 in bug on rank 1"), s
    assert "broadcast #1 at `wrap_fsdp1` (rank 1: fp32 bucket of 2 tensors, 256 B in fix vs bf16 bucket of 27 " \
           "tensors, 853888 B in bug)" in s
    assert d.given_dtype is None and d.first["kind"] == "dtype"
    whole = wb.diff(f"{bundle}@fp32-everywhere", bundle, labels=("fp32", "bf16"))
    assert whole.given_dtype == ("float32", "bfloat16") and whole.first["name"].endswith("inv_freq")
