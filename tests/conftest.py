"""Shared fixtures: one real 2-rank gloo cluster for the tests that can share it.

Engines cost 7-10 s to start on 2 cores, so tests share one cluster where that stays
honest (each session starts from a fresh per-rank context, and a dirty process group
is re-formed before the next session). Tests that break the cluster on purpose start
their own.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("PYTHONWARNINGS", "ignore")


def _own_lane() -> str | None:
    """Under pytest-xdist (``make test`` runs the suite in lanes), this worker's own ``TMPDIR`` and
    ``IPYTHONDIR``, set before any test runs; the lane's directory (None outside xdist).

    The lanes run side by side on one machine, so what a test reads back from the temp dir (what a run
    left there) or from the profile directory (``workbench status``, ``down`` without an id, which
    stops the profile's one orphaned cluster) must be its own lane's, never another lane's live
    engines. The engines, torchrun jobs and CLI runs a test starts inherit both."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return None
    lane = tempfile.mkdtemp(prefix=f"pytest-lane-{worker}-")
    for var, sub in (("TMPDIR", "tmp"), ("IPYTHONDIR", "ipython")):
        os.makedirs(os.path.join(lane, sub))
        os.environ[var] = os.path.join(lane, sub)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    return lane


LANE = _own_lane()


def pytest_unconfigure(config):
    """The lane's profiles go; its temp dir only when empty (what a test leaked stays for a look)."""
    if LANE is None:
        return
    shutil.rmtree(os.path.join(LANE, "ipython"), ignore_errors=True)
    for d in (os.path.join(LANE, "tmp"), LANE):
        try:
            os.rmdir(d)
        except OSError:
            break

TEST_TIMEOUT_S = 8.0  # collective timeout: short, so the headline's gloo send times out quickly


@pytest.fixture(scope="session")
def cluster():
    import workbench as wb

    c = wb.start(ranks=2, backend="gloo", timeout=TEST_TIMEOUT_S)
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
