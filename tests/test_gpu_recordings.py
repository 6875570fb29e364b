"""The committed GPU recordings are consistent with what they claim to be (fixtures/gpu/, scripts/gpu_real_size.sh).

These import no workbench code and run nothing: they check a recording's consistency (the rows, the diagnosis,
the flags saying which run it was), so that a later reading of it cannot be a different run's. Whether a recorded
figure meets its speed goal is a benchmark's to print (`benchmarks/gpu_recorded.py`), never a test's.

- weight-sync-order-desync's bug path at 4 NCCL ranks: with the release aborting each group's backend and leaving
  torch's registry alone (rank/control.py), no workbench artefact ('Group ... is not registered') among the rank
  errors; rank 0's later call on the subgroup it kept fails as the hang's symptom.
- benchmarks/real_size.py: the probe rows and the diagnosis at real size, the first GPU probe with the kernel
  warmed when the ranks join their group, and without (the baseline).
"""

from __future__ import annotations

import json
from pathlib import Path

GPU = Path(__file__).resolve().parents[1] / "fixtures" / "gpu"


def test_recording_of_order_desync_at_4_ranks_lists_no_unregistered_group():
    text = (GPU / "order_desync_trace_4gpu.txt").read_text()
    assert "is not registered" not in text and "ValueError" not in text
    deliver = text.split("== 7:deliver_2", 1)[1].split("\n== 8:", 1)[0]
    assert "rank 0 error DistBackendError: NCCL communicator was aborted" in deliver
    assert "no default group" not in text  # every rank keeps its groups after the release


def test_recording_of_recovery_at_4_ranks_still_right_with_the_registry_kept():
    cycles = json.loads((GPU / "hang_cycles_nccl_4gpu.json").read_text())["rows"]
    hangs = [c for c in cycles if not c.get("death")]
    assert len(hangs) >= 20 and all(c["check_ok"] and not c["restarted"] for c in hangs)
    assert all(c["check_ok"] for c in cycles) and not any(c["replayed_hung"] for c in cycles)
    assert "frame state: 4/4 cycles right" in (GPU / "frame_state_nccl_4gpu.txt").read_text()


def test_recording_of_real_size_rows_and_diagnosis():
    runs = {r["ranks"]: r for r in json.loads((GPU / "real_size_round1.json").read_text())["runs"]}
    base = json.loads((GPU / "real_size_nowarm.json").read_text())["runs"][0]
    assert sorted(runs) == [2, 4]
    for n, r in [*runs.items(), (4, base)]:
        assert r["versions"]["gpu"].startswith("NVIDIA") and r["triton_cache_cold"]
        assert all(s["ok"] for s in r["cold"] + r["warm"])
        assert {s["rows"] for s in r["cold"]} == {312 * n}  # 1248 rows a step at 4 ranks
        assert "`inv_freq`, `original_inv_freq`" in r["diagnosis"] and "never written" in r["diagnosis"]
    assert all(r["probe_warm"] for r in runs.values()) and not base["probe_warm"]  # the baseline is unwarmed


def _run(name: str) -> dict:
    return json.loads((GPU / name).read_text())["runs"][0]


def test_recording_of_first_probe_on_one_machine_three_times():
    runs = [_run(f"real_size_4gpu_run{i}.json") for i in (1, 2, 3)]
    assert [r["triton_cache_cold"] for r in runs] == [True, False, True]
    assert all(len(r["warm_after_run"]) == r["ranks"] for r in runs)  # every rank says how it warmed


def test_recording_of_a_probe_pause_names_the_gc_probe_step():
    """The reading behind the GC pause, as recorded: every step has its overhead and its slowest GC probe, the
    step with the spike is the one whose GC probe was slowest, and the prototype run is the one that says it froze
    the collector. How long the pause may be is a speed target: benchmarks/gpu_recorded.py, not a test."""
    plain, frozen = _run("real_size_gc.json"), _run("real_size_gc_freeze.json")
    steps = plain["cold"][3:] + plain["warm"]
    for key in ("overhead_s", "slowest_gc_probe_s"):  # timings: present and positive; their bounds live in benchmarks/
        assert all(isinstance(s[key], (int, float)) and s[key] > 0 for s in steps), key
    spike = max(range(len(steps)), key=lambda i: steps[i]["overhead_s"])
    assert spike == max(range(len(steps)), key=lambda i: steps[i]["slowest_gc_probe_s"])  # the same step, by index
    assert frozen["gc_freeze_prototype"] and not plain["gc_freeze_prototype"]


def test_recording_of_real_size_with_the_gc_pause_at_2_and_4_gpus():
    """The product's path (no prototype): the warm-up and the rank's GC pause; four warm passes."""
    runs = {r["ranks"]: r for r in json.loads((GPU / "real_size.json").read_text())["runs"]}
    assert sorted(runs) == [2, 4]
    for r in runs.values():
        assert not r["gc_freeze_prototype"] and r["probe_warm"] and r["triton_cache_cold"] and r["passes"] == 4
        assert all(s["ok"] for s in r["cold"] + r["warm"]) and len(r["warm"]) == 16
        assert {"overhead", "first_probe"} <= set(r["goals"])  # the benchmark's figures are in the recording
    s4 = runs[4]  # start at 4 GPUs: its parts are recorded (the goal is not met, see docs/performance.md)
    assert s4["start_s"] > 0 and {"client_init_s", "engines_s", "imports_s", "group_s"} <= set(s4)
    gc_pause = json.loads((GPU / "hang_cycles_nccl_4gpu_gc_pause.json").read_text())["rows"]
    assert all(c["check_ok"] and not c["replayed_hung"] for c in gc_pause)


def test_recording_of_an_unmodified_job_under_workbench_job_on_4_gpus():
    """scripts/gpu_job_zero_code.sh: the Llama-3.2-1B-shaped FSDP2 job with no workbench line, plain and under the
    wrapper; every run ended 0, the captured runs took the automatic points and their reports name inv_freq."""
    rec = json.loads((GPU / "job_zero_code_4gpu.json").read_text())
    assert rec["gpus"] == rec["ranks"] == 4 and rec["shape"] == "llama-3.2-1b"
    assert {r["mode"] for r in rec["runs"]} == {"off", "defaults", "every1"} and all(r["rc"] == 0 for r in rec["runs"])
    for r in (r for r in rec["runs"] if r["mode"] != "off"):
        assert r["points"][:4] == ["fully_shard", "to_empty", "forward", "step1"], r["points"]
        assert "`inv_freq`, `original_inv_freq`" in r["sentence"] and "at step `to_empty`" in r["sentence"]
        assert "hung" not in r["sentence"], r["sentence"]


def test_recording_of_a_point_every_step_left_on_has_every_way():
    """scripts/gpu_job_leave_on.sh (issue 62): a check of the recording, not of its figures. Every way the job ran
    (off, the in-code defaults, zero-code ``--every 1``) has its figure fresh, warm and compiled, the in-code
    job's first point on the job's thread is recorded, and so is each capturing job's in-process ratio
    (``--paired``)."""
    for path in sorted(GPU.glob("job_leave_on_*gpu.json")):
        rec = json.loads(path.read_text())
        for key in ("loop_ms", "fresh_loop_ms", "compiled_loop_ms"):
            assert {"off", "defaults", "zero_code"} <= set(rec[key]), (path.name, key, rec[key])
        assert "fresh" in rec["first_point_ms"], (path.name, rec["first_point_ms"])
        assert all(rec["paired_ratio"].get(m) for m in ("defaults", "zero_code")), (path.name, rec["paired_ratio"])
    assert any(GPU.glob("job_leave_on_*gpu.json"))
    rec = json.loads((GPU / "job_leave_on_1gpu.json").read_text())  # c0095b9: the last proof, this stop's code
    assert all(r["rc"] == 0 for r in rec["runs"]), [(r["mode_key"], r["round"], r["rc"]) for r in rec["runs"]]
    for way in ("defaults", "zero_code"):
        for how, fresh in (("eager", True), ("eager", False), ("compiled", False)):
            (job,) = _paired_jobs(rec, way, how, fresh)
            assert job["pairs"] >= 100 and job["ci95"][0] <= job["pair_ratio"] <= job["ci95"][1], (way, how, job)


def test_recording_of_the_long_paired_reading_has_both_capturing_ways():
    """benchmarks/job_leave_on.py --paired 300 --paired-block 2 (issue 62): a check of the recording. Each capturing
    way (in-code defaults, zero-code ``--every 1``) has its pair ratio with a 95% interval over at least 100 pairs of
    on/off steps within one process, the reading that can show 3% through the host's ±10% between steps."""
    rec = json.loads((GPU / "paired_leave_on_1gpu.json").read_text())
    assert rec["device"] and rec["device"] != "cpu"
    for way in ("defaults", "zero_code"):
        (job,) = rec["paired_ci95"][way]
        lo, hi = job["ci95"]
        assert job["pairs"] >= 100 and lo <= job["pair_ratio"] <= hi, (way, job)


def _paired_jobs(rec: dict, way: str, how: str, fresh: bool) -> list[dict]:
    return [r[how]["paired"] for r in rec["runs"]
            if r["mode_key"] == way and r["fresh"] == fresh and (r.get(how) or {}).get("paired")]


def test_recording_of_the_long_paired_reading_compiled_and_fresh():
    """benchmarks/job_leave_on.py --rounds 2 ... --paired-compiled (issue 62): a check of the recording. Each
    capturing way has a long paired reading on the fresh round (eager) and on the warm one, eager and compiled."""
    rec = json.loads((GPU / "paired_compiled_1gpu.json").read_text())
    assert rec["device"] and rec["device"] != "cpu"
    for way in ("defaults", "zero_code"):
        for how, fresh in (("eager", True), ("eager", False), ("compiled", False)):
            (job,) = _paired_jobs(rec, way, how, fresh)
            lo, hi = job["ci95"]
            assert job["pairs"] >= 100 and lo <= job["pair_ratio"] <= hi, (way, how, fresh, job)


def test_recording_of_the_long_paired_reading_on_fresh_caches_compiled_too():
    """benchmarks/job_leave_on.py --rounds 1 ... --fresh-compile --paired-compiled (issue 62): a check of the
    recording. One round on fresh caches, each capturing way read eager and compiled over at least 100 pairs, the
    in-code point called as a job calls it (no sync first); the first point's time is recorded."""
    rec = json.loads((GPU / "paired_fresh_1gpu.json").read_text())
    assert rec["device"] and rec["device"] != "cpu" and rec["sync_before_point"] is False
    assert rec["first_point_ms"]["fresh"] > 0
    for way in ("defaults", "zero_code"):
        for how in ("eager", "compiled"):
            (job,) = _paired_jobs(rec, way, how, True)
            assert job["pairs"] >= 100 and job["ci95"][0] <= job["pair_ratio"] <= job["ci95"][1], (way, how, job)


def test_recording_of_the_in_code_point_split_by_its_objects():
    """benchmarks/point_cost.py with and without the logits, and the paired reading of in-code points of the model
    alone (scripts/gpu_point_split.sh, issue 62): a check of the recording. Both point_cost readings finished their
    points on the writer with the job's thread's rows; the paired one took no logits."""
    for what, logits in (("logits", True), ("model", False)):
        rec = json.loads((GPU / f"point_cost_{what}_1gpu.json").read_text())
        assert rec["logits"] is logits and rec["device"] != "cpu", what
        assert rec["point_ms"] > 0 and rec["drain_ms"] > 0 and rec["step_ms"] > 0, what
        assert rec["rows_match"] is True and rec["deferred_points"] == rec["all_points"] > 0, what
    rec = json.loads((GPU / "paired_no_logits_1gpu.json").read_text())
    assert rec["in_code_logits"] is False
    for way in ("defaults", "zero_code"):
        (job,) = rec["paired_ci95"][way]
        assert job["pairs"] >= 100 and job["ci95"][0] <= job["pair_ratio"] <= job["ci95"][1], (way, job)


def test_recording_of_the_two_ways_points_on_the_jobs_thread():
    """benchmarks/point_ways.py (issue 62): a check of the recording. Each way's job timed ``opt.step()`` with and
    without its point over its pairs, the writer's drain apart; the profiled reading names where the zero-code
    step hook's time went (``owners.py``'s walks, fixed after it)."""
    rec = json.loads((GPU / "point_ways_1gpu.json").read_text())
    assert {r["way"] for r in rec["runs"]} == {"in_code", "zero_code"}
    for r in rec["runs"]:
        assert r["device"] != "cpu" and len(r["on_ms_all"]) == len(r["off_ms_all"]) == r["pairs"] > 0, r["way"]
        assert abs(r["point_ms"] - (r["step_host_on_ms"] - r["step_host_off_ms"])) < 0.002 and r["drain_ms"] > 0
    again = json.loads((GPU / "point_ways_reread_1gpu.json").read_text())  # after the owner cache (fc19edb)
    assert {r["way"] for r in again["runs"]} == {"in_code", "zero_code"}
    assert all(len(r["on_ms_all"]) == len(r["off_ms_all"]) == r["pairs"] > 0 for r in again["runs"])
    prof = json.loads((GPU / "point_ways_profile_1gpu.json").read_text())
    zero = next(r for r in prof["runs"] if r["way"] == "zero_code")
    assert "owners.py" in zero["profile"] and "hooks.py" in zero["profile"]


def test_recording_of_the_writers_lag_read_both_ways():
    """scripts/gpu_writer_lag.sh (issue 62): a check of the recording. Each capturing way's job took the writer's
    lag in turns, pair by pair (0 s and 1 s), at least 100 pairs each, every interval holding its median; the
    reading before it ran one job per lag (``writer_lags_apart_1gpu.json``: each job with its lag said)."""
    rec = json.loads((GPU / "writer_lag_1gpu.json").read_text())
    assert rec["device"] and rec["device"] != "cpu"
    for way in ("defaults", "zero_code"):
        (job,) = rec["paired_ci95"][way]
        assert set(job["by_lag"]) == {"0", "1"}, (way, job)
        for lag in job["by_lag"].values():
            assert lag["pairs"] >= 100 and lag["ci95"][0] <= lag["pair_ratio"] <= lag["ci95"][1], (way, lag)
    apart = json.loads((GPU / "writer_lags_apart_1gpu.json").read_text())
    for way in ("defaults", "zero_code"):
        assert sorted(j["writer_lag"] for j in apart["paired_ci95"][way]) == [0.0, 1.0], way


def test_recording_of_the_nvrtc_probe_kernel_matches_tritons():
    """benchmarks/probe_nvrtc.py (issue 62): a check of the recording. The CUDA probe kernel NVRTC builds was
    compared with Triton's over every tensor it lists, and through the dispatch a job's point takes, with no
    mismatch; its build time and both kernels' times are recorded."""
    paths = sorted(GPU.glob("probe_nvrtc_*gpu.json"))
    assert paths
    for path in paths:
        rec = json.loads(path.read_text())
        assert rec["nvrtc_build"]["nvrtc"] is True and rec["nvrtc_build"]["build_s"] > 0, path.name
        assert rec["tensors"] > 0 and rec["dispatch_rows"] > 0, path.name
        assert rec["identical"] is True and rec["n_mismatches"] == 0 and not rec["mismatches"], path.name
        assert {"triton", "nvrtc"} <= set(rec["kernel_ms"]), path.name
        if "plain_first_ms" in rec:  # since d7b558e: the plain path's first call, and its sums of squares checked
            assert rec["plain_sumsq_exact"] is True and rec["plain_point_ms_with_a_sync_a_tensor"] > 0, path.name


def test_recording_of_a_warm_points_host_time_names_where_it_goes():
    """benchmarks/point_cost.py (issue 62): a check of the recording. A warm point's time on the job's thread and
    the writer's drain are recorded beside the step, for every point timed, with the profile by own time that
    says where the host's time goes; and whether the points were finished on the writer, with their rows checked
    against the job's thread's at one point (``rows_match``)."""
    paths = sorted(GPU.glob("point_cost_*gpu.json"))
    assert paths
    for path in paths:
        rec = json.loads(path.read_text())
        assert rec["device"] != "cpu" and rec["tensors"] > 0, path.name
        assert len(rec["point_ms_all"]) == rec["points"] and all(x > 0 for x in rec["point_ms_all"]), path.name
        assert {"step_ms", "point_ms", "drain_ms"} <= set(rec), path.name
        assert "capture_points.py" in rec["profile_cumulative"] and "ncalls" in rec["profile_tottime"], path.name
        outputs = 1 if rec.get("logits", True) else 0  # the logits' row, unless the points took the model alone
        assert rec["rows_match"] is True and rec["rows_checked"] == rec["tensors"] + outputs, path.name
        assert 0 < rec["deferred_points"] <= rec["all_points"], path.name


def test_recording_of_the_probe_at_scale_with_nvrtcs_kernel():
    """benchmarks/probe_scale.py --kernel nvrtc (issue 62): a check of the recording. The fused pass ran NVRTC's kernel,
    its rows equal the plain path's (means to float32 order) with the planted NaN, Inf and poison seen, and the
    floor it is measured against is recorded."""
    for name in ("probe_scale_nvrtc_1gpu.json", "probe_scale_reread_1gpu.json"):
        rec = json.loads((GPU / name).read_text())
        assert rec["fused_kernel"].get("kernel") == "nvrtc" and rec["paths"]["fused"]["packed"] is True, name
        assert rec["fused_vs_plain_equal"] is True and rec["planted_seen"] == {"nan": 1, "inf": 1, "poison": 2045}
        assert rec["floor_ms"] > 0 and rec["paths"]["fused"]["probe_ms"] > 0, name


def test_recording_of_the_lightning_trainer_its_own_launcher_started_on_2_gpus():
    """scripts/gpu_pl_selflaunch.sh: a check of the recording. ``Trainer(devices=2)`` run as ``python train.py`` on two
    H200s (NCCL, no torchrun): under ``workbench job`` each run exited as it did alone with the same stdout, both ranks
    captured on their own GPU from their join, Flight Recorder's rows among the ledger's (DDP's reducer), a point every
    step; right read clean, the clip under ``is_global_zero`` as rank 1 parting from rank 0's replica at ``step1``."""
    rec = json.loads((GPU / "pl_selflaunch_2gpu.json").read_text())
    for name in ("right", "bug"):
        run = rec["runs"][name]
        assert run["plain"]["rc"] == run["job"]["rc"] == 0 and run["same_stdout"] is True, name
        ranks = run["capture"]["ranks"]
        for r in ("0", "1"):
            assert ranks[r]["backend"] == "nccl" and ranks[r]["device"].startswith(f"cuda:{r}"), (name, r)
            assert ranks[r]["launcher"] is None and ranks[r]["status"] == "finished", (name, r)
            assert ranks[r]["ledger_rows"].get("flight_recorder", 0) > 0, (name, r)
            assert ranks[r]["points"][:2] == ["forward", "step1"] and len(ranks[r]["points"]) == 5, (name, r)
    assert rec["runs"]["right"]["capture"]["diagnosis"]["clean"] is True
    bug = rec["runs"]["bug"]["capture"]["diagnosis"]
    assert bug["clean"] is False and bug["ranks"] == [1] and bug["step"] == "step1" and "DDP replica" in bug["sentence"]


def test_recording_of_where_each_rank_loads_the_probes_kernel_on_2_gpus():
    """scripts/gpu_warm_device.sh, before and after the fix (8680856): a check of the recording. A torchrun job whose
    first CUDA call is ``set_device(local_rank)``: plain, each rank holds memory on its own GPU only. Under ``workbench
    job`` before, rank 1 also held GPU 0 (the warm-up's context) and its kernel was loaded for ``cuda:0``; after, each
    rank holds its own GPU only and its kernel is loaded there."""
    rec = json.loads((GPU / "warm_device_2gpu.json").read_text())
    for label in ("before_0d05621", "after_8680856"):
        for r in ("0", "1"):
            assert [g for g, _ in rec[label]["plain"][r]["gpus_held"]] == [int(r)], (label, r)
    before = rec["before_0d05621"]["job"]["1"]
    assert sorted(g for g, _ in before["gpus_held"]) == [0, 1] and before["warm"]["result"]["device"] == "cuda:0"
    for r in ("0", "1"):
        after = rec["after_8680856"]["job"][r]
        assert [g for g, _ in after["gpus_held"]] == [int(r)], (r, after)
        assert after["warm"]["result"]["device"] == f"cuda:{r}" and after["warm"]["result"]["warm"] is True, (r, after)
