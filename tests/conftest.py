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
    "tests/test_user_scenarios.py": 272,
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
