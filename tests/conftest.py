"""Shared fixtures: one real 2-rank gloo cluster for the tests that can share it.

Engines cost 7-10 s to start on 2 cores, so tests share one cluster where that stays
honest (each session starts from a fresh per-rank context, and a dirty process group
is re-formed before the next session). Tests that break the cluster on purpose start
their own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile

import pytest

os.environ.setdefault("PYTHONWARNINGS", "ignore")


LANE = os.environ.get("PYTEST_XDIST_WORKER")  # this lane's name under pytest-xdist (``make test``), else None


def pytest_configure(config):
    config.addinivalue_line("markers", "check: in `make check`'s set (CHECK and CHECK_END_TO_END below)")
    _lane_dirs(config)


def _lane_dirs(config) -> None:
    """Under pytest-xdist, this lane's own ``TMPDIR`` and ``IPYTHONDIR``, set before any test runs.

    The lanes run side by side on one machine, so what a test reads back from the temp dir (what a run
    left there) or from the profile directory (``workbench status``, ``down`` without an id, which
    stops the profile's one orphaned cluster) must be its own lane's, never another lane's live
    engines. The engines, torchrun jobs and CLI runs a test starts inherit both. They live in the run's
    basetemp, beside the lanes' ``tmp_path`` folders, and pytest prunes them with those."""
    if LANE is None:
        return
    run = os.path.dirname(str(config.option.basetemp))  # the lane's own basetemp is emptied when first used
    for var, sub in (("TMPDIR", "tmp"), ("IPYTHONDIR", "ipython")):
        os.environ[var] = os.path.join(run, f"{LANE}-{sub}")
        os.makedirs(os.environ[var], exist_ok=True)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def _costly_first(items) -> None:
    """Under pytest-xdist: the test files reordered, the costliest first (``COST_S``), each file's tests kept
    together and in their order. ``make test`` hands a lane one file at a time in this order
    (``--dist loadfile --no-loadscope-reorder``), so no long file starts last and runs alone at the end."""
    def cost(item) -> float:
        return COST_S.get(item.nodeid.split("::", 1)[0], 0.0)

    items.sort(key=lambda item: -cost(item))  # stable: a file's tests stay in order, light files as collected


def pytest_collection_modifyitems(config, items):
    for item in items:  # a test's every parametrization when its id is listed without one
        if {item.nodeid, item.nodeid.split("[", 1)[0]} & CHECK_IDS or item.nodeid.startswith(CHECK_FILES):
            item.add_marker(pytest.mark.check)
    if LANE is not None:
        _costly_first(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked ``alone`` runs while no other lane runs a test: one whose waits or bounds must not share
    the machine's two cores (its fixtures' set-up and tear-down included, as for every test)."""
    if LANE is None:
        yield
        return
    with _lanes_lock(item.config, exclusive=item.get_closest_marker("alone") is not None):
        yield


@contextlib.contextmanager
def _lanes_lock(config, exclusive: bool):
    """Every lane's test holds the room shared, an ``alone`` test holds it exclusive. The gate in front of it
    makes a waiting ``alone`` test go next (shared holders alone would keep the room for ever)."""
    base = os.path.dirname(str(config.option.basetemp))  # the run's basetemp: one per run, every lane's parent
    with open(os.path.join(base, "lanes.gate"), "a") as gate, open(os.path.join(base, "lanes.room"), "a") as room:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


# What each test file cost in one lane, in seconds (the suite in 3 lanes on a 2-core box shared with other
# work, 2026-11-27: slow, but in proportion): ``make test``'s lanes start the costliest first. A file missing
# here (under 100 s there) counts as light and runs after these.
COST_S: dict[str, float] = {
    "tests/test_fixtures.py": 1375,
    "tests/test_browser.py": 1092,
    "tests/test_job.py": 1085,
    "tests/test_bundle.py": 1060,
    "tests/test_notebooks.py": 789,
    "tests/test_meshes.py": 743,
    "tests/test_multihost.py": 705,
    "tests/test_job_attach.py": 578,
    "tests/test_cli.py": 550,
    "tests/test_attach.py": 499,
    "tests/test_docs.py": 496,
    "tests/test_vllm_weightsync.py": 463,
    "tests/test_rerun.py": 455,
    "tests/test_registry_faults.py": 449,
    "tests/test_faults.py": 422,
    "tests/test_diagnosis.py": 347,
    "tests/test_stacks.py": 330,  # 2026-11-29, by the helpers' runs on a loaded box: 100-346 s
    "tests/test_user_scenarios.py": 272,
    "tests/test_detectors_stack.py": 200,
    "tests/test_ledger_kinds.py": 180,
    "tests/test_diff_world.py": 115,
    "tests/test_job_guest.py": 105,
    "tests/test_teach.py": 261,
    "tests/test_lifetime.py": 155,
    "tests/test_tempfiles.py": 128,
    "tests/test_flightrecorder.py": 113,
    "tests/test_viz_scale.py": 103,
}

BUNDLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "bundles")
_PAGES: dict[str, str] = {}


@pytest.fixture(scope="session")
def recorded_report(tmp_path_factory):
    """``recorded_report(name)``: ``report.render`` of the recorded bundle ``fixtures/bundles/<name>.wbundle``,
    rendered once per run, every lane included (a render is ~6 CPU-s on the 2-core box, and three files read
    the same nine pages: test_fixtures renders them, test_bundle reads their words, test_browser draws them).

    The page is a pure function of the bundle's bytes (test_bundle checks that byte for byte), so it is kept
    under the bundle's sha256 in the run's basetemp, which every lane shares; a lane that wants a page another
    lane is rendering waits on its lock and reads it."""
    import hashlib

    from workbench.postmortem import bundle, report

    shared = tmp_path_factory.getbasetemp()
    if LANE is not None:
        shared = shared.parent  # the run's basetemp: one per run, every lane's parent
    shared = shared / "recorded-pages"
    shared.mkdir(exist_ok=True)

    def page(name: str) -> str:
        path = os.path.join(BUNDLES, f"{name}.wbundle")
        with open(path, "rb") as f:
            key = f"{name}-{hashlib.sha256(f.read()).hexdigest()[:16]}"
        if key in _PAGES:
            return _PAGES[key]
        done = shared / f"{key}.html"
        with open(shared / f"{key}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                tmp = shared / f"{key}.{os.getpid()}.tmp"
                tmp.write_text(report.render(bundle.load(path)), encoding="utf-8")
                os.replace(tmp, done)
        _PAGES[key] = done.read_text(encoding="utf-8")
        return _PAGES[key]

    return page


TEST_TIMEOUT_S = 8.0  # collective timeout: short, so the headline's gloo send times out quickly


@pytest.fixture(scope="session")
def cluster():
    import workbench as wb

    c = wb.start(ranks=2, backend="gloo", timeout=TEST_TIMEOUT_S)
    yield c
    c.stop()


MESH_TIMEOUT_S = 20.0  # the 4-rank group's collective timeout: a call released sooner was released by the ledgers


@pytest.fixture(scope="session")
def mesh4():
    """One 4-rank gloo cluster for the files that need four ranks (``test_meshes`` at 4 ranks, the two-pair user
    scenarios of ``test_user_scenarios``): a lane that runs both starts four engines once, not twice. Its users
    take it through ``ready()``, as the 2-rank cluster's do."""
    import workbench as wb

    c = wb.start(ranks=4, backend="gloo", timeout=MESH_TIMEOUT_S)
    yield c
    c.stop()


ANOTHER_CPU = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.fixture(scope="session")
def another_cpu():
    """A second 2-rank cluster whose engines run other float kernels (no SIMD in ATen, oneDNN capped at AVX2).

    It stands in for another CPU, so what must read the same on any machine (a fixture's rerun, a receiver's
    verdict) is checked in CI on one: the recorder's kernels are an input the tests vary."""
    import workbench as wb

    c = wb.start(ranks=2, backend="gloo", timeout=TEST_TIMEOUT_S, env=ANOTHER_CPU)
    yield c
    c.stop()



def free_port() -> int:
    """A loopback port nothing listens on now (the OS's pick), for a job's rendezvous or a test's server."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready(cluster):
    """``cluster``, restarted first if an earlier test left it stopped or a rank dead or stuck (shared by the
    modules that keep a cluster of their own: ``from conftest import ready``)."""
    if not cluster.alive or cluster.dead_ranks() or not cluster.wait_idle(cluster.timeout + 15):
        cluster.restart()
    return cluster


@pytest.fixture()
def healthy(cluster):
    """The shared cluster, restarted first if an earlier test left a rank dead or stuck."""
    return ready(cluster)


# -- make check: a few minutes for every change ----------------------------------------------------------------------
# One test for each module of workbench/ (CHECK: its file -> the test's node id, listed by test), in process or on
# the one shared 2-rank cluster, plus the end-to-end path: the headline incident run by the CLI with its report,
# and a torchrun job captured by `workbench job` and reported. Those tests are marked `check`; `make check` runs
# `-m check` in one process. tests/test_check.py fails when a module has no entry, or its test neither names nor
# imports it.
CHECK_END_TO_END: tuple[str, ...] = (
    "tests/test_cli.py::test_run_writes_json_in_the_frames_vocabulary_and_a_report",
    "tests/test_job_zero_code.py::test_the_fsdp2_job_unmodified_reads_as_the_manual_points_do",
)
CHECK_BY_TEST: dict[str, tuple[str, ...]] = {
    "tests/test_capture_config.py::test_to_env_reads_back_as_it_was": (
        "workbench/job/config.py",
    ),
    "tests/test_cli.py::test_run_writes_json_in_the_frames_vocabulary_and_a_report": (
        "workbench/cli.py", "workbench/lab/__init__.py", "workbench/lab/buffers.py", "workbench/lab/fsdp_cpu.py",
        "workbench/rank/__init__.py", "workbench/rank/trace.py", "workbench/scenario.py",
        "workbench/scenarios/fsdp1_rotary_meta_init.py",
    ),
    "tests/test_client_imports.py::test_auto_backend_on_a_machine_without_a_gpu_driver_imports_no_torch": (
        "workbench/live/engines.py", "workbench/rank/host.py",
    ),
    "tests/test_client_imports.py::test_scenario_declarations_and_the_attach_path_import_no_torch": (
        "workbench/live/connect.py", "workbench/live/registry.py",
    ),
    "tests/test_close_leaves_torch.py::test_close_gives_back_every_patch_mode_hook_and_thread": (
        "workbench/job/process.py", "workbench/rank/patch.py",
    ),
    "tests/test_close_leaves_torch.py::test_a_ranks_files_undo_what_they_opened_and_installed_on_the_stack_they_"
    "were_given": (
        "workbench/rank/ledger_calls.py", "workbench/rank/shard_files.py",
    ),
    "tests/test_collectives.py::test_an_argument_c10d_refuses_is_the_raising_ranks_cause": (
        "workbench/analysis/cause.py", "workbench/analysis/stacks.py",
    ),
    "tests/test_collectives.py::test_ledger_file_is_readable_line_by_line_while_open": (
        "workbench/rank/ledger.py", "workbench/rank/traffic.py",
    ),
    "tests/test_collectives.py::test_the_library_line_is_the_innermost_module_that_issued_the_call": (
        "workbench/rank/ledger_fr.py",
    ),
    "tests/test_deadlock.py::test_a_finished_rank_whose_call_was_another_size_leaves_its_peer_waiting": (
        "workbench/analysis/deadlock.py", "workbench/rank/waitfor.py",
    ),
    "tests/test_detectors.py::test_divergence_names_the_diverging_rank_only": (
        "workbench/analysis/findings.py",
    ),
    "tests/test_detectors.py::test_rope_reference_is_exact_for_a_correct_bf16_cast_and_catches_garbage": (
        "workbench/lab/models.py", "workbench/rank/reference.py",
    ),
    "tests/test_detectors_stack.py::test_every_to_empty_keeps_what_was_real_and_returns_what_torch_returns": (
        "workbench/job/materialise.py",
    ),
    "tests/test_detectors_stack.py::test_the_loss_watch_reads_each_loss_once_and_steps_aside_after_the_first_bad_one": (
        "workbench/job/keys.py", "workbench/job/losses.py",
    ),
    "tests/test_detectors_stack.py::test_the_optimizer_step_is_probed_as_the_topmost_module_that_owns_its_parameters": (
        "workbench/job/owners.py",
    ),
    "tests/test_diagnosis.py::test_every_catalogue_scenario_has_an_expected_diagnosis": (
        "workbench/lab/toy_moe.py", "workbench/lab/weightsync/conversion.py", "workbench/lab/weightsync/defaults.py",
        "workbench/lab/weightsync/model.py", "workbench/lab/weightsync/pack.py", "workbench/lab/weightsync/receive.py",
        "workbench/lab/weightsync/vllm_role.py", "workbench/scenarios/__init__.py",
        "workbench/scenarios/eval_loop_uneven_batches.py", "workbench/scenarios/fsdp2_nonpersistent_buffer_sync.py",
        "workbench/scenarios/hsdp_replicas_diverge_at_init.py", "workbench/scenarios/router_bias_bf16.py",
        "workbench/scenarios/stale_conversion_cache.py", "workbench/scenarios/to_empty_clobbers_buffers.py",
        "workbench/scenarios/weight_sync_order_desync.py", "workbench/scenarios/weight_sync_rank0_metadata.py",
    ),
    "tests/test_diagnosis_rules.py::test_a_fault_before_the_parting_leads_it": (
        "workbench/analysis/collectives.py", "workbench/analysis/diagnosis.py",
        "workbench/analysis/diagnosis_rules/__init__.py", "workbench/analysis/diagnosis_rules/exception.py",
        "workbench/analysis/diagnosis_rules/parting.py", "workbench/analysis/diagnosis_rules/rule.py",
        "workbench/analysis/diagnosis_rules/story.py", "workbench/analysis/diagnosis_run.py",
        "workbench/analysis/diagnosis_type.py", "workbench/analysis/diagnosis_words.py",
        "workbench/analysis/flightrecorder.py", "workbench/analysis/floor.py",
        "workbench/analysis/frames.py", "workbench/analysis/rankgroups.py", "workbench/analysis/trace.py",
        "workbench/analysis/weightsync_order.py", "workbench/rank/ledger_read.py",
    ),
    "tests/test_close_leaves_torch.py::test_the_close_names_who_holds_the_world_group_after_the_job_destroyed_it": (
        "workbench/job/teardown.py",
    ),
    "tests/test_diagnosis_rules.py::test_agreed_wrong_pre_empts_wrong_value": (
        "workbench/analysis/diagnosis_rules/tensor.py", "workbench/analysis/weightsync.py",
    ),
    "tests/test_diff.py::test_a_fix_against_its_bug_path_from_one_recorded_bundle": (
        "workbench/postmortem/diff.py",
    ),
    "tests/test_engine_fork.py::test_the_engines_are_forked_from_one_set_process_that_imported_torch": (
        "workbench/live/engine_fork.py", "workbench/rank/remote.py",
    ),
    "tests/test_faults.py::test_a_path_in_the_temp_dir_is_written_as_tmp_wherever_tmpdir_points": (
        "workbench/postmortem/bundle.py",
    ),
    "tests/test_job.py::test_a_point_is_on_disk_when_it_returns_and_an_exception_is_a_line": (
        "workbench/job/__init__.py", "workbench/postmortem/shards.py", "workbench/rank/shard_format.py",
    ),
    "tests/test_job.py::test_srun_sets_rank_world_and_job": (
        "workbench/job/engine.py", "workbench/job/shard.py", "workbench/rank/phases.py",
    ),
    "tests/test_job_guest.py::test_nocapture_answers_every_public_method_and_property_of_capture": (
        "workbench/job/api.py", "workbench/job/capture_attach.py", "workbench/job/capture_points.py",
        "workbench/job/capture_reads.py",
    ),
    "tests/test_job_zero_code.py::test_the_fsdp2_job_unmodified_reads_as_the_manual_points_do": (
        "workbench/__init__.py", "workbench/analysis/__init__.py", "workbench/postmortem/__init__.py",
    ),
    "tests/test_job_zero_code.py::test_without_the_variable_the_site_hook_imports_nothing_and_chains_the_jobs_own": (
        "workbench/job/debug_server.py", "workbench/job/guest.py", "workbench/job/hooks.py",
        "workbench/job/launcher.py",
        "workbench/job/site/sitecustomize.py", "workbench/job/triggers.py", "workbench/job/writer.py",
    ),
    "tests/test_mirror.py::test_a_remote_rank_that_missed_a_poll_in_the_step_is_read_once_the_step_ends": (
        "workbench/live/mirror.py", "workbench/rank/control.py",
    ),
    "tests/test_probe.py::test_cpu_shortcuts_give_the_general_paths_values": (
        "workbench/rank/fingerprint.py",
    ),
    "tests/test_progress.py::test_a_done_rank_and_a_rank_waiting_in_a_collective": (
        "workbench/analysis/progress.py",
    ),
    "tests/test_progress.py::test_the_hang_view_and_the_report_show_the_proof_and_each_stuck_ranks_stack": (
        "workbench/postmortem/record.py", "workbench/postmortem/report.py", "workbench/viz/__init__.py",
        "workbench/viz/collectives.py", "workbench/viz/diagnosis.py", "workbench/viz/diff.py", "workbench/viz/sweep.py",
        "workbench/viz/weightsync.py", "workbench/viz/weightsync_cycles.py",
    ),
    "tests/test_progress.py::test_the_stepper_shows_the_line_in_its_own_widget": (
        "workbench/live/progress.py", "workbench/live/release.py", "workbench/live/session.py",
        "workbench/live/stepper.py", "workbench/rank/byname.py",
    ),
    "tests/test_rank_side.py::test_a_warm_rank_has_the_rank_layer_and_no_hub_progress_bars": (
        "workbench/rank/agree.py", "workbench/rank/context.py", "workbench/rank/warmup.py",
    ),
    "tests/test_rank_side.py::test_each_rank_has_its_stacks_file_and_a_manifest_of_its_temp_paths": (
        "workbench/rank/leftovers.py", "workbench/rank/stacks.py",
    ),
    "tests/test_rank_side.py::test_each_rank_holds_the_rank_its_group_formed_with": (
        "workbench/rank/state.py",
    ),
    "tests/test_rank_side.py::test_every_engine_carries_the_clusters_lease_and_its_reaper_runs": (
        "workbench/live/__init__.py", "workbench/live/lease.py",
    ),
    "tests/test_rank_side.py::test_probing_cpu_tensors_never_loads_the_triton_kernel": (
        "workbench/rank/_probe_triton.py", "workbench/rank/columns.py", "workbench/rank/mesh_facts.py",
        "workbench/rank/poison.py", "workbench/rank/probe.py", "workbench/rank/probe_cpu.py",
        "workbench/rank/probe_fused.py",
    ),
    "tests/test_point_deferred.py::test_a_point_finished_on_the_writer_writes_the_rows_the_jobs_thread_would": (
        "workbench/rank/point_deferred.py",
    ),
    "tests/test_probe_nvrtc.py::test_where_nvrtc_cannot_build_it_says_why_once_and_the_warm_up_goes_on_to_tritons": (
        "workbench/rank/_probe_nvrtc.py",
    ),
    "tests/test_rank_side.py::test_the_probes_child_build_runs_once_and_says_why_it_built_nothing_without_cuda": (
        "workbench/rank/_probe_build.py", "workbench/rank/probe_child.py",
    ),
    "tests/test_rank_side.py::test_the_engines_print_through_the_quiet_stream": (
        "workbench/rank/outstream.py",
    ),
    "tests/test_rerun.py::test_tolerances_are_stated_per_dtype": (
        "workbench/postmortem/closeness.py", "workbench/postmortem/rerun.py",
    ),
    "tests/test_sweep.py::test_combinations_cover_the_grid_in_order": (
        "workbench/live/cluster.py",
    ),
    "tests/test_sweep.py::test_a_sweep_with_an_unknown_parameter_fails_before_any_engine": (
        "workbench/errors.py", "workbench/live/sweep.py",
    ),
    "tests/test_teach.py::test_bad_input_is_one_line_before_any_rank_runs": (
        "workbench/teach/grade.py", "workbench/teach/moe.py", "workbench/teach/steps.py",
    ),
    "tests/test_teach.py::test_exercise_steps_travel_by_reference_and_the_client_imports_no_torch": (
        "workbench/teach/__init__.py", "workbench/teach/exercises.py", "workbench/teach/solutions.py",
    ),
    "tests/test_viz_scale.py::test_64_ranks_by_60_tensors_stays_small": (
        "workbench/analysis/synthetic.py", "workbench/viz/tensors.py",
    ),
    "tests/test_weightsync_order.py::test_check_names_the_first_mismatching_index_and_both_names": (
        "workbench/lab/weightsync/broadcast.py",
    ),
    "tests/test_weightsync_rank.py::test_handle_rebuilds_in_another_process_on_the_same_memory": (
        "workbench/lab/weightsync/__init__.py", "workbench/lab/weightsync/ipc.py",
    ),
}
CHECK: dict[str, str] = {module: test for test, modules in CHECK_BY_TEST.items() for module in modules}
CHECK_FILES = ("tests/test_check.py", "tests/test_layout.py")  # static, a second or two: every test in them
CHECK_IDS = frozenset(CHECK.values()) | set(CHECK_END_TO_END)
