"""The bundles the GPU suite recorded on 2 x H200 (NCCL): they load, render, and say what NCCL did.

Recorded by `bash scripts/gpu_suite.sh` through the device tool; no GPU is needed to read them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import workbench as wb

GPU = Path(__file__).resolve().parent.parent / "fixtures" / "gpu"
BUNDLES = sorted(GPU.glob("*.bundle"))
INV = "model.model.rotary_emb.inv_freq"


def first(path: Path):
    return next(iter(wb.load(path)))


# Fixes added after the last 2-GPU recording would go here until a machine with two GPUs records them
# (`bash scripts/gpu_suite.sh --only fsdp1-rotary-meta-init`). Each entry must still be a fix of the catalogue
# and must not have a recording (then it leaves this list). fsdp1's fp32-everywhere and sync-buffers-after-wrap
# were recorded on 2 x H100 (suite_fsdp1.*, env_fsdp1.txt); its other runs here are the 2 x H200 recording.
# hsdp-replicas-diverge-at-init is recorded on 4 GPUs (a 2 x 2 mesh) by `bash scripts/gpu_hsdp.sh` (4 x H200, after
# the engines stopped binding the device on a re-formed group: see workbench.rank.context.bind_device).
HSDP = "hsdp-replicas-diverge-at-init"
NOT_YET_ON_NCCL: set[tuple[str, str | None]] = set()
RANKS_OF = {HSDP: 4}  # recorded at another world size than the suite's 2 GPUs


def test_every_scenario_and_fix_was_recorded_on_nccl():
    assert len(BUNDLES) >= 10
    recorded = {(r.manifest["scenario"], r.manifest.get("fix")) for r in map(first, BUNDLES)}
    from workbench import scenarios

    for name in scenarios.names():
        for fix in [None, *scenarios.get(name).fixes]:
            if (name, fix) in NOT_YET_ON_NCCL:
                assert (name, fix) not in recorded, f"{name} / {fix} is recorded now: drop it from NOT_YET_ON_NCCL"
                continue
            assert (name, fix) in recorded, f"{name} / {fix} has no GPU recording"
    for name, fix in NOT_YET_ON_NCCL:
        assert fix is None or fix in scenarios.get(name).fixes, (name, fix)
    for path in BUNDLES:
        m = first(path).manifest
        n = RANKS_OF.get(m["scenario"], 2)
        assert m["backend"] == "nccl" and m["devices"] == {str(r): f"cuda:{r}" for r in range(n)}, path.name


def test_hsdp_on_nccl_names_the_replicas_that_parted_and_both_fixes_are_clean():
    """Issue 48's GPU proof: the HSDP scenario on 4 GPUs (NCCL), a 2 x 2 mesh."""
    if (HSDP, None) in NOT_YET_ON_NCCL:
        pytest.skip("not recorded on NCCL yet: bash scripts/gpu_hsdp.sh on 4 GPUs")
    bug = first(GPU / f"{HSDP}__bug.bundle")
    d = bug.diagnose()
    assert d.mechanism == "replicas-parted" and d.step == "materialize" and d.ranks == [2, 3], d.sentence
    assert "differ between the replicas (mesh dim `replicate`: ranks 0,1 vs 2,3) from step `materialize`" \
        in d.sentence, d.sentence
    assert bug.events.empty  # silent: nothing raised on any rank
    for fix in ("seed-per-shard", "broadcast-along-replicate"):
        assert first(GPU / f"{HSDP}__{fix}.bundle").diagnose().clean, fix


def test_headline_on_nccl_small_bucket_hangs_rank1_stream():
    rec = first(GPU / "fsdp1-rotary-meta-init__bug.bundle")
    ev = rec.events
    assert list(ev["rank"]) == [1] and ev.iloc[0]["kind"] == "timeout" and ev.iloc[0]["step"] == "wrap_fsdp1"


def test_headline_on_nccl_larger_bucket_returns_silently_with_shifted_tensors():
    rec = first(GPU / "fsdp1-rotary-meta-init__bug_at_3.4MB-bucket.bundle")
    assert rec.events.empty  # no error anywhere: the mispairing is silent
    out = rec.outputs.set_index("rank")
    assert (out["nan"] == 0).all()
    assert out.loc[0, "ref_max_abs_diff"] == 0.0 and 1.0 < out.loc[1, "ref_max_abs_diff"] < 3.0
    t = rec.tensors
    r1 = t[(t["step"] == "wrap_fsdp1") & (t["rank"] == 1) & (t["name"] == INV)].iloc[0]
    assert r1["dtype"] == "bfloat16" and list(r1["head"]) == [0.0] * 8  # inv_freq all zeros on rank 1


def test_fix_is_clean_on_nccl():
    rec = first(GPU / "fsdp1-rotary-meta-init__cast-params-only.bundle")
    out = rec.outputs
    last = out[out["step_index"] == out["step_index"].max()]
    assert rec.events.empty and (last["ref_max_abs_diff"] == 0.0).all() and last["fingerprint"].nunique() == 1


@pytest.mark.parametrize("name", ["fsdp1-rotary-meta-init__bug_at_3.4MB-bucket.bundle",
                                  "fsdp2-nonpersistent-buffer-sync__bug.bundle"])
def test_gpu_bundle_renders_a_report(name, tmp_path):
    page = wb.report.write(wb.load(GPU / name), tmp_path / "r.html").read_text()
    assert "nccl" in page and "cuda:1" in page and page.count("plotly-graph-div") >= 3


def test_recording_of_a_jobs_truth_on_4_gpus():
    """What issue 45's GPU run recorded (scripts/job_truth_gpu.py on 4 x H200), re-read here, no GPU run: the clean
    job's sentence, the post mortem's probe ranks, every check passed, and each deadlocked job ended by the post
    mortem's release of its waiting ranks (not its group's own timeout)."""
    doc = json.loads((GPU / "job_truth_4gpu.json").read_text())
    assert doc["ok"] and all(c["ok"] for r in doc["runs"] for c in r["checks"])
    assert "inv_freq" in doc["clean_sentence"] and "hung" not in doc["clean_sentence"]
    assert doc["postmortem_probe_ranks"] == [0, 1, 2, 3]
    deadlocks = [r for r in doc["runs"] if r["job"].startswith("deadlock")]
    assert len(deadlocks) == 2 and all(r["rc"] == 1 and r["end_lines"] for r in deadlocks)
    assert all("released from" in ln and "by the post mortem" in ln for r in deadlocks for ln in r["end_lines"])


def test_recording_of_a_broadcast_whose_ranks_disagree_on_the_root_on_nccl():
    """What `python scripts/gpu_roots.py` recorded on 2 x H200 (issue 48), re-read here, no GPU run: NCCL returns
    such a broadcast at once with no error (each rank is the root of its own call, nothing moves: rank 1 keeps its
    1.0s), so nothing hangs or raises; the live session and a torchrun job's capture still named it from the
    ledgers, and one root read clean."""
    rec = json.loads((GPU / "roots_nccl_2gpu.json").read_text())
    assert rec["env"]["backend"] == "nccl" and rec["env"]["count"] == 2, rec["env"]
    live, job = rec["live"], rec["job"]
    assert live["bug"]["devices"] == {"0": "cuda:0", "1": "cuda:1"}
    assert live["bug"]["rank_errors"] == {} and live["bug"]["released"] == []  # silent on NCCL: nothing to release
    for sentence in (live["bug"]["sentence"], job["bug"]["sentence"]):
        assert "part at group 0 call #1" in sentence and "(different roots)" in sentence, sentence
        assert "src=0" in sentence and "src=1" in sentence, sentence
    assert job["bug"]["rc"] == 0 and "rank 1 holds [1.0, 1.0, 1.0, 1.0]" in job["bug"]["stdout"]  # the silent part
    for path in (live["one-root"], job["one-root"]):
        assert path["sentence"].startswith("clean: "), path["sentence"]
    assert job["one-root"]["rc"] == 0


def test_a_users_own_fsdp2_job_on_nccl_reads_right_as_clean_and_names_its_buffer(tmp_path):
    """`bash scripts/gpu_user_job.sh` on 2 x H200 (its three captures, fixtures/gpu/user_job_nccl_2gpu.tgz): a user's
    FSDP2 script, unmodified, under `workbench job`. Before the capture read Flight Recorder ahead of
    ``destroy_process_group`` and kept a call numbered before its entry, the right job read 'rank 1 never issued
    group 0 call #1' on a cold machine, and the buggy one 'rank 0 never issued ... call #6'. Every rank holds every
    call (84 all-gathers and reduce-scatters), the right and lingering jobs read clean, the bug is its buffer."""
    import tarfile

    with tarfile.open(GPU / "user_job_nccl_2gpu.tgz") as tar:
        tar.extractall(tmp_path, filter="data")
    for name in ("right", "linger", "bug"):
        rec = wb.load(tmp_path / name).bug
        led = rec.ledger
        seqs = {r: sorted(led[led["rank"] == r]["seq"]) for r in (0, 1)}  # a row per call
        assert seqs[0] == seqs[1] == list(range(1, 85)), (name, {r: len(s) for r, s in seqs.items()})
        assert rec.manifest["job"]["status"] == {"0": "finished", "1": "finished"}, name
        sentence = rec.diagnose().sentence
        if name == "bug":
            assert sentence.startswith("`scale` on rank 1 differs"), sentence
        else:
            assert rec.diagnose().clean, (name, sentence)


def test_recording_of_megatron_fsdp_on_gpu_names_the_clobbered_router_bias_and_its_fix_reads_clean(tmp_path):
    """`bash scripts/gpu_megatron_fsdp.sh` on one H200 (fixtures/gpu/megatron_fsdp_1gpu.*, issue 60): a user's MoE job
    on the real megatron-fsdp 0.6.1, unmodified, under `workbench job`. Its router's `expert_bias`, made real (zeros)
    inside the meta context, is replaced by Megatron-FSDP's `to_empty(recurse=False)`: plainly the job runs on with
    leftover memory there; under the capture (poison) its losses are NaN. The workbench's diagnosis, re-run here on
    the recorded shards, names the buffer by module path and the `to_empty` that clobbered it, with the defaults and
    with `--every 1`; the fix (the buffer made on meta, written in `reset_parameters`) reads clean both ways."""
    import tarfile

    rec = json.loads((GPU / "megatron_fsdp_1gpu.json").read_text())
    runs = rec["runs"]
    assert rec["megatron_fsdp"] == "0.6.1" and all(r["rc"] == 0 for r in runs.values()), rec
    assert any(v != 0.0 for v in runs["plain-bug"]["result"]["expert_bias"][0])  # the silent part: not its zeros
    assert runs["fix"]["result"]["expert_bias"] == [[0.0] * 8] * 2
    with tarfile.open(GPU / "megatron_fsdp_1gpu.tgz") as tar:
        tar.extractall(tmp_path, filter="data")
    for name in ("bug", "bug-every1"):
        sentence = wb.load(tmp_path / name).bug.diagnose().sentence
        assert sentence.startswith("`blocks.0.router.expert_bias` was real (zeros) before `to_empty(recurse=False)`"), \
            (name, sentence)
        assert "`blocks.1.router.expert_bias`" in sentence, (name, sentence)
    for name in ("fix", "fix-every1"):
        diagnosis = wb.load(tmp_path / name).bug.diagnose()
        assert diagnosis.clean, (name, diagnosis.sentence)
