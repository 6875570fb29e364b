"""Flight Recorder interop: ledger -> dumps that PyTorch's analyser reads, real dumps -> the ledger table.

The round trip runs PyTorch's own analyser (``torch.distributed.flight_recorder``) on the
export; the import is checked on dumps recorded here from two real gloo ranks
(``scripts/fr_dump.py``) and on a 2-GPU NCCL recording in ``fixtures/gpu/flightrecorder``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from workbench import cli
from workbench.analysis import collectives
from workbench.analysis.flightrecorder import FlightRecorderError, read_dump, to_flight_recorder

ROOT = Path(__file__).resolve().parents[1]
NCCL_FIXTURE = ROOT / "fixtures" / "gpu" / "flightrecorder"
PREFIX = "nccl_trace_rank_"
KEEP = ["rank", "step", "group", "seq", "op", "dtypes", "shapes", "numel", "bytes", "via", "bucket", "state"]


def _call(rank: int, seq: int, op: str, dtype: str, shape: list[int], state: str = "completed", **kw) -> dict:
    numel = 1
    for d in shape:
        numel *= d
    size = {"float32": 4, "bfloat16": 2}[dtype]
    return {"rank": rank, "session": "s", "attempt": 0, "step": "wrap", "group": "0", "group_ranks": [0, 1],
            "seq": seq, "op": op, "dtypes": [dtype], "shapes": [shape], "numel": numel, "bytes": numel * size,
            "state": state, "t_start": 100.0 + seq + rank / 10, "t_end": 100.5 + seq if state == "completed" else None,
            "user_frame": f"/work/model.py:{10 + seq} init", **kw}


def matched_ledger() -> pd.DataFrame:
    rows = []
    for r in (0, 1):
        rows += [_call(r, 1, "all_reduce", "float32", [4]),
                 _call(r, 2, "broadcast", "float32", [16], src=0, via="_broadcast_coalesced", bucket=0),
                 _call(r, 3, "broadcast", "bfloat16", [202112], src=0, via="_broadcast_coalesced", bucket=1),
                 _call(r, 4, "all_gather_into_tensor", "bfloat16", [64]),
                 _call(r, 5, "reduce_scatter_tensor", "float32", [128]),
                 _call(r, 6, "barrier", "float32", [1])]
    return collectives.ledger_table(rows)


def mismatched_ledger() -> pd.DataFrame:
    """The headline incident: rank 0 broadcasts an fp32 bucket then a bf16 one, rank 1 one bf16 bucket."""
    co = {"src": 0, "via": "_broadcast_coalesced"}
    return collectives.ledger_table([
        _call(0, 1, "broadcast", "float32", [16], bucket=0, **co),
        _call(0, 2, "broadcast", "bfloat16", [202112], state="started", bucket=1, **co),
        _call(1, 1, "broadcast", "bfloat16", [202128], bucket=0, **co),
    ])


def _fr_trace(directory: Path) -> subprocess.CompletedProcess:
    """The installed ``torchfrtrace`` command, as a user would run it."""
    exe = Path(sys.executable).parent / "torchfrtrace"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
    return subprocess.run([*cmd, str(directory), "-p", PREFIX], capture_output=True, text=True, timeout=120)


def _torch_db(directory: Path, caplog: pytest.LogCaptureFixture | None = None):
    """PyTorch's analyser through its Python API (what ``torchfrtrace`` runs, in-process): the database of
    paired collectives, and with ``caplog`` also what it printed."""
    import gc

    from torch.distributed.flight_recorder.components.builder import build_db
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from torch.distributed.flight_recorder.components.loader import read_dir

    args = JobConfig().parse_args([str(directory), "-p", PREFIX])
    was = gc.isenabled()
    try:
        details, version = read_dir(args)
    finally:  # torch's loader disables the garbage collector and never turns it back on (a CLI's shortcut)
        if was:
            gc.enable()
    if caplog is None:
        return build_db(details, args, version)
    caplog.clear()
    with caplog.at_level("INFO", logger="Flight Recorder"):
        db = build_db(details, args, version)
    return db, "\n".join(r.getMessage() for r in caplog.records)


# -- export -> PyTorch's analyser -> import ------------------------------------------------
def test_export_writes_torchs_dump_format(tmp_path):
    files = to_flight_recorder(matched_ledger(), tmp_path)
    assert [f.name for f in files] == [f"{PREFIX}0", f"{PREFIX}1"]
    dump = pickle.loads(files[0].read_bytes())
    assert dump["version"] == "2.10" and dump["pg_config"] == {"0": {"name": "0", "desc": "default_pg",
                                                                    "ranks": "[0, 1]"}}
    e = dump["entries"][2]
    assert (e["profiling_name"], e["collective_seq_id"], e["input_sizes"], e["input_dtypes"], e["state"]) == (
        "gloo:broadcast", 3, [[202112]], ["BFloat16"], "completed")
    gather = dump["entries"][3]
    assert gather["profiling_name"] == "gloo:_all_gather_base" and gather["output_sizes"] == [[128]]
    assert dump["pg_status"]["0"]["last_completed_collective"] == 6


def test_torch_analyser_reads_a_matched_export_and_pairs_every_call(tmp_path):
    to_flight_recorder(matched_ledger(), tmp_path)
    db = _torch_db(tmp_path)
    assert len(db.collectives) == 6
    assert all(c.pass_check and not c.missing_ranks for c in db.collectives), db.collectives
    assert [c.collective_name for c in db.collectives][:3] == ["gloo:all_reduce", "gloo:broadcast", "gloo:broadcast"]


def test_torch_analyser_reports_the_mismatch_of_an_export_and_the_import_gives_it_back(tmp_path):
    ledger = mismatched_ledger()
    to_flight_recorder(ledger, tmp_path)
    run = _fr_trace(tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "Collective sequence number: 1 has errors" in out
    assert "SIZE_OR_SYNTAX_MISMATCH" in out and "[[16]]" in out and "[[202128]]" in out

    back = collectives.from_flight_recorder(tmp_path)
    pd.testing.assert_frame_equal(back[KEEP], ledger[KEEP])
    assert list(back["c10d_op"]) == ["gloo:broadcast"] * 3
    div = collectives.first_divergence(back)
    assert (div.kind, div.seq, div.ranks) == (collectives.first_divergence(ledger).kind, 1, [0])


def test_round_trip_keeps_rows_ops_sizes_and_dtypes(tmp_path):
    ledger = matched_ledger()
    collectives.to_flight_recorder(ledger, tmp_path / "fr", backend="nccl")  # the wb.collectives spelling
    back = collectives.from_flight_recorder(tmp_path / "fr")
    cols = [*KEEP, "group_ranks", "src"]
    pd.testing.assert_frame_equal(back[cols], ledger[cols])
    assert back["c10d_op"].str.startswith("nccl:").all()
    assert collectives.first_divergence(back) is None
    # without the workbench's extra key the FR fields alone still give op, seq, sizes, dtypes, state
    for f in (tmp_path / "fr").iterdir():
        dump = pickle.loads(f.read_bytes())
        for e in dump["entries"]:
            del e["workbench"]
        f.write_bytes(pickle.dumps(dump))
    bare = collectives.from_flight_recorder(tmp_path / "fr")
    cols = ["rank", "group", "seq", "op", "dtypes", "shapes", "numel", "bytes", "state"]
    pd.testing.assert_frame_equal(bare[cols], ledger[cols])


def test_a_real_scenario_ledger_through_torchs_analyser(tmp_path, caplog):
    """The headline incident's ledger from a real 2-rank gloo run (a saved bundle): bug path and fix."""
    import workbench as wb

    bug, fix = list(wb.load(ROOT / "fixtures" / "bundles" / "fsdp1-rotary-meta-init.wbundle"))[:2]
    assert fix.manifest["fix"] == "cast-params-only"
    to_flight_recorder(bug.ledger, tmp_path / "bug")
    db, out = _torch_db(tmp_path / "bug", caplog)
    assert not db.collectives[0].pass_check
    assert "Collective sequence number: 1 has errors" in out and "[[64]]" in out and "[[426944]]" in out
    back = collectives.from_flight_recorder(tmp_path / "bug")
    pd.testing.assert_frame_equal(back[KEEP], bug.ledger[KEEP])  # "timed out" survives Flight Recorder's states
    before, after = collectives.first_divergence(bug.ledger), collectives.first_divergence(back)
    assert (after.kind, after.seq, after.ranks, after.message) == (before.kind, 1, [0], before.message)

    to_flight_recorder(fix.ledger, tmp_path / "fix")
    db = _torch_db(tmp_path / "fix")
    assert len(db.collectives) == len(fix.ledger) // 2 and all(c.pass_check for c in db.collectives)


def test_a_recorded_run_exports_under_its_own_backend(tmp_path):
    """A run recorded on NCCL (2 x H200) exports as nccl:... entries that torch's analyser reads; the same
    ledger passed bare would be named for gloo."""
    import pickle

    import workbench as wb

    rec = wb.load(ROOT / "fixtures" / "gpu" / "eval-loop-uneven-batches__bug.bundle")[0]
    assert rec.manifest["backend"] == "nccl" and len(rec.ledger)
    files = rec.to_flight_recorder(tmp_path / "nccl")
    names = {e["profiling_name"].split(":")[0] for f in files for e in pickle.loads(f.read_bytes())["entries"]}
    assert names == {"nccl"}
    assert not all(c.pass_check for c in _torch_db(tmp_path / "nccl").collectives)  # its hang: all_reduce vs all_gather


# -- real dumps -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gloo_dumps(tmp_path_factory) -> Path:
    """Two real gloo ranks (scripts/fr_dump.py): a dtype-mismatched broadcast at #2, rank 0 left in #4."""
    out = tmp_path_factory.mktemp("fr-gloo")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "fr_dump.py"), str(out), "--format", "both"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def _check_recorded_mismatch(ledger: pd.DataFrame, backend: str) -> None:
    assert set(ledger["rank"]) == {0, 1} and (ledger["c10d_op"].str.split(":").str[0] == backend).all()
    div = collectives.first_divergence(ledger)
    assert (div.kind, div.group, div.seq, div.call["op"]) == ("dtype", "0", 2, "broadcast")
    assert "float32 [8] 32 B" in div.message and "bfloat16 [16] 32 B" in div.message
    hang = collectives.diagnose("fr", ledger, {}, [0, 1])
    assert list(hang.stuck) == [0] and hang.stuck[0].startswith("all_reduce #4 float32 [2] 8 B")
    assert hang.finished == [1]
    opened = ledger[ledger["state"] == collectives.OPEN]
    assert list(zip(opened["rank"], opened["seq"], strict=True)) == [(0, 4)]


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_import_of_real_gloo_dumps(gloo_dumps, fmt):
    raw = read_dump(next((gloo_dumps / fmt).iterdir()))
    assert "" in raw["pg_config"]  # gloo's quirk: the default group is filed under an empty name
    assert {e["state"] for e in raw["entries"]} == {"scheduled"}  # ... and never leaves "scheduled"
    ledger = collectives.from_flight_recorder(gloo_dumps / fmt)
    _check_recorded_mismatch(ledger, "gloo")
    if fmt == "pickle":
        assert ledger["user_frame"].str.contains("fr_dump.py").all()


def test_real_gloo_dumps_converted_for_torchs_analyser(gloo_dumps, tmp_path, caplog):
    """A gloo dump torch's analyser cannot pair (empty group name) goes through import + export."""
    to_flight_recorder(collectives.from_flight_recorder(gloo_dumps / "pickle"), tmp_path)
    _, out = _torch_db(tmp_path, caplog)
    assert "Collective sequence number: 2 has errors" in out and "'[[8]]' does not match found input sizes: " \
        "'[[16]]'" in out
    assert "Not all ranks joining collective, sequence number: 4" in out


def test_cli_frtrace_prints_the_divergence_and_writes_the_swimlane(gloo_dumps, tmp_path, capsys):
    html = tmp_path / "lanes.html"
    assert cli.main(["frtrace", str(gloo_dumps / "pickle"), "--html", str(html)]) == 1
    out = capsys.readouterr().out
    assert "7 calls from 2 ranks (gloo)" in out
    assert "rank 0: inside all_reduce #4" in out
    assert "first divergence: group 0 call #2: different dtypes" in out
    assert html.stat().st_size > 10_000 and "first divergence" in html.read_text()


@pytest.mark.skipif(not NCCL_FIXTURE.is_dir(), reason="no NCCL Flight Recorder fixture recorded")
@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_import_of_a_recorded_nccl_dump(fmt):
    ledger = collectives.from_flight_recorder(NCCL_FIXTURE / fmt)
    _check_recorded_mismatch(ledger, "nccl")
    done = ledger[ledger["state"] == "completed"]
    assert len(done) == 6 and done["t_end"].notna().all()  # NCCL keeps timing; gloo does not


def _fr_entry(record_id: int, name: str, sizes: list, seq: int = 0, p2p_seq: int = 0, dtype: str = "Float") -> dict:
    """One entry as NCCL's Flight Recorder writes it (2 x H200 recording: fixtures/gpu/flightrecorder)."""
    return {"record_id": record_id, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": p2p_seq, "op_id": record_id + 1, "profiling_name": f"nccl:{name}",
            "time_created_ns": 10**18 + record_id, "input_sizes": sizes, "input_dtypes": [dtype] * len(sizes),
            "output_sizes": sizes, "output_dtypes": [dtype] * len(sizes), "state": "completed", "retired": True,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": 10**18 + record_id + 5,
            "is_p2p": name.startswith(("send", "recv")), "frames": []}


def _write_dumps(directory: Path, entries: dict[int, list[dict]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, es in entries.items():
        dump = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
                "pg_status": {}, "entries": es}
        (directory / f"{PREFIX}{rank}").write_bytes(pickle.dumps(dump))
    return directory


def test_send_pairs_with_recv_per_pair_of_ranks(tmp_path):
    def job(last_recv: int) -> dict[int, list[dict]]:
        return {0: [_fr_entry(0, "all_reduce", [[4]], seq=1), _fr_entry(1, "send 0->1", [[8]], p2p_seq=1),
                    _fr_entry(2, "send 0->1", [[8]], p2p_seq=2)],
                1: [_fr_entry(0, "all_reduce", [[4]], seq=1), _fr_entry(1, "recv 1<-0", [[8]], p2p_seq=1),
                    _fr_entry(2, "recv 1<-0", [[last_recv]], p2p_seq=2)]}

    ok = collectives.from_flight_recorder(_write_dumps(tmp_path / "ok", job(8)))
    p2p = ok[ok["group"] == "0:p2p 0-1"]
    assert list(zip(p2p["rank"], p2p["seq"], p2p["op"], p2p["src"], p2p["dst"], strict=True)) == [
        (0, 1, "send", 0, 1), (0, 2, "send", 0, 1), (1, 1, "recv", 0, 1), (1, 2, "recv", 0, 1)]
    assert collectives.first_divergence(ok) is None
    div = collectives.first_divergence(collectives.from_flight_recorder(_write_dumps(tmp_path / "bad", job(16))))
    assert (div.kind, div.group, div.seq) == ("size", "0:p2p 0-1", 2)


def test_a_coalesced_group_is_its_calls_without_the_marker(tmp_path):
    calls = {r: [_fr_entry(0, "_all_gather_base", [[64]], seq=1), _fr_entry(1, "_all_gather_base", [[32]], seq=1),
                 _fr_entry(2, "coalesced", [], seq=1), _fr_entry(3, "all_reduce", [[4]], seq=2)] for r in (0, 1)}
    ledger = collectives.from_flight_recorder(_write_dumps(tmp_path, calls))
    mine = ledger[ledger["rank"] == 0]
    assert list(zip(mine["seq"], mine["op"], mine["via"].fillna("-"), mine["bucket"].fillna(-1), strict=True)) == [
        (1, "all_gather_into_tensor", "coalesced", 0), (1, "all_gather_into_tensor", "coalesced", 1),
        (2, "all_reduce", "-", -1)]
    assert collectives.first_divergence(ledger) is None


def test_a_wrapped_ring_buffer_is_cut_to_the_calls_every_rank_holds(tmp_path):
    calls = {r: [_fr_entry(i, "all_reduce", [[4]], seq=i + 1) for i in range(5)] for r in (0, 1)}
    calls[0] = calls[0][2:]  # rank 0's buffer lost #1 and #2
    ledger = collectives.from_flight_recorder(_write_dumps(tmp_path, calls))
    assert sorted(ledger.loc[ledger["rank"] == 1, "seq"]) == [3, 4, 5]
    assert collectives.first_divergence(ledger) is None


# -- bad input ------------------------------------------------------------------------------
def _bad_inputs(tmp: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "empty").mkdir()
    (tmp / "corrupt").mkdir()
    (tmp / "corrupt" / f"{PREFIX}0").write_bytes(b"\x80\x04garbage")
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / f"{PREFIX}0").write_bytes(pickle.dumps(argparse.Namespace(entries=[])))
    (tmp / "nojson").mkdir()
    (tmp / "nojson" / "rank0.json").write_text(json.dumps({"version": "2.10"}))
    (tmp / "twice").mkdir()
    (tmp / "twice" / "rank0").write_bytes(pickle.dumps({"entries": []}))
    (tmp / "twice" / "rank0.json").write_text("{}")
    return {
        "missing": (tmp / "nope", "no such file or directory"),
        "empty": (tmp / "empty", "no Flight Recorder dumps named <prefix><rank>"),
        "corrupt": (tmp / "corrupt", "not a readable Flight Recorder dump (pickle"),
        "foreign": (tmp / "foreign", "argparse.Namespace; a Flight Recorder dump holds plain data only"),
        "nojson": (tmp / "nojson", "not a Flight Recorder dump (no 'entries' list)"),
        "twice": (tmp / "twice", "two dumps of rank 0"),
    }


def test_bad_input_is_one_clear_line(tmp_path, capsys):
    for name, (path, words) in _bad_inputs(tmp_path).items():
        with pytest.raises(FlightRecorderError) as err:
            collectives.from_flight_recorder(path)
        assert words in str(err.value) and "\n" not in str(err.value), (name, str(err.value))
        assert cli.main(["frtrace", str(path)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("workbench: error: ") and words in lines[0], (name, lines)
    with pytest.raises(FlightRecorderError, match="nothing to export"):
        to_flight_recorder(collectives.ledger_table([]), tmp_path / "out")
