"""The post-mortem watch's own faults are said, once, and never the job's (``job/triggers.py``, issue 63).

A store that is down is not a key that is absent: the watcher used to read both as "no trigger yet" and
poll a dead store for ever, and a trigger the store would not take left the post mortem unstarted with
nothing said. The role a rank holds in the post mortem is one ``Role``, set in one place under the
watch's lock; whoever waits for the serving to end waits on an event, not a sleep loop.
"""

from __future__ import annotations

import datetime
import threading
from types import SimpleNamespace

import pytest
from torch.distributed import TCPStore

from workbench.job import engine, triggers
from workbench.job.triggers import Role


class DeadStore:
    """A dead ``TCPStore``'s client: every call fails (its server's process is gone)."""

    def __init__(self):
        self.calls = 0

    def _fail(self, *args, **kwargs):
        self.calls += 1
        raise RuntimeError("Connection reset by peer")

    check = get = set = add = wait = _fail


def _cap(tmp_path, rank=0, world=2):
    return SimpleNamespace(rank=rank, world_size=world, root=str(tmp_path), attempt=0, closed=False, ledger_path=None,
                           job_excepthook=None, open_calls=lambda: [], watch_flight_recorder=lambda s: 0)


@pytest.fixture
def tcp_store():
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=1), wait_for_workers=False)
    assert store.port > 0
    return store


def test_an_absent_key_of_a_live_store_is_absent_not_a_fault(tcp_store):
    assert triggers._has(tcp_store, "wb/post-mortem/go") is False
    assert triggers._get(tcp_store, "wb/post-mortem/go") is None  # its get times out (1 s) on the absent key
    tcp_store.set("wb/post-mortem/go", '{"reason": "error", "rank": 1}')
    assert triggers._has(tcp_store, "wb/post-mortem/go") is True
    assert triggers._get(tcp_store, "wb/post-mortem/go") == {"reason": "error", "rank": 1}


def test_a_store_that_is_down_is_told_apart_from_an_absent_key():
    store = DeadStore()
    with pytest.raises(triggers.StoreDown, match="Connection reset by peer"):
        triggers._has(store, "k")
    with pytest.raises(triggers.StoreDown) as got:
        triggers._get(store, "k")
    assert isinstance(got.value.cause, RuntimeError)
    assert triggers._peek(store, "k") is None and triggers._there(store, "k") is False  # serving goes on


def test_the_watcher_says_once_it_lost_the_store_and_stops_polling(tmp_path, monkeypatch, capfd):
    store = DeadStore()
    monkeypatch.setattr(engine, "job_store", lambda: store)
    watch = triggers.install(_cap(tmp_path, rank=1), ("error",), 5.0, 2.0, poll=0.01)
    try:
        watch.thread.join(30)
        assert not watch.thread.is_alive(), "the watcher polls a dead store for ever"
    finally:
        watch.end()
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "lost the job's store" in line]
    assert len(said) == 1, err
    assert said[0].startswith("workbench: rank 1's post-mortem watcher lost the job's store: RuntimeError: "
                              "Connection reset by peer"), said
    assert said[0].endswith("post mortem off on this rank"), said
    assert store.calls >= triggers.STORE_LOST_AFTER


def test_a_store_gone_with_the_jobs_groups_is_no_fault(tmp_path, monkeypatch, capfd):
    """The job destroyed its groups (``job_store`` answers None now): the watcher stops without a word."""
    store = DeadStore()
    answers = iter([store])
    monkeypatch.setattr(engine, "job_store", lambda: next(answers, None))
    watch = triggers.install(_cap(tmp_path), ("error",), 5.0, 2.0, poll=0.01)
    try:
        watch.thread.join(30)
        assert not watch.thread.is_alive()
    finally:
        watch.end()
    assert store.calls >= triggers.STORE_LOST_AFTER
    assert "workbench" not in capfd.readouterr().err


def _raised():
    try:
        raise ValueError("loss is nan")
    except ValueError as exc:
        return exc


def test_a_trigger_the_store_will_not_take_is_said_once(tmp_path, monkeypatch, capfd):
    store = DeadStore()
    served = []
    monkeypatch.setattr(engine, "job_store", lambda: store)
    monkeypatch.setattr(triggers, "_serve", lambda *a, **k: served.append(a) or {"by": "deadline"})
    cap = _cap(tmp_path, rank=1)
    watch = triggers.Watch(("error",), 5.0, 2.0)
    exc = _raised()
    assert triggers.on_exception(cap, watch, exc, exc.__traceback__) == {"by": "deadline"}  # the job goes on
    triggers._not_started(cap, watch, RuntimeError("again"))  # a second failure of the same kind
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "post mortem could not be started" in line]
    assert said == ["workbench: rank 1: the post mortem could not be started: the job's store did not take its "
                    "trigger (RuntimeError: Connection reset by peer); the job goes on as it would have"], err
    assert "attachable" not in err  # no wait line: no rank was told
    assert len(served) == 1


def test_the_role_is_one_enum_with_the_strings_it_had():
    assert [r.value for r in Role] == ["raised", "waiting", "served"]
    watch = triggers.Watch(("error",), 5.0, 2.0)
    assert watch.take(Role.WAITING) is None and watch.role is Role.WAITING
    assert watch.take(Role.RAISED) is Role.WAITING and watch.role is Role.WAITING  # the first one stands
    assert not watch.served.is_set()
    assert watch.take(Role.SERVED) is Role.WAITING and watch.role is Role.SERVED and watch.served.is_set()


def test_an_error_while_the_watcher_serves_waits_for_the_serving_to_end(tmp_path):
    """A rank's main thread raises while its watcher serves another rank's post mortem: it waits until that
    serving is over (the event, no sleep loop), then fails as the job would have (None: it served nothing)."""
    watch = triggers.Watch(("error",), 5.0, 2.0)
    assert watch.take(Role.WAITING) is None
    out: list = []
    exc = _raised()
    main = threading.Thread(target=lambda: out.append(triggers.on_exception(_cap(tmp_path), watch, exc, None)))
    main.start()
    main.join(0.3)
    assert main.is_alive() and out == []  # still waiting: the watcher serves
    watch.take(Role.SERVED)
    main.join(30)
    assert not main.is_alive() and out == [None]


def test_end_still_joins_a_polling_watcher_only(tmp_path, monkeypatch):
    """``Watch.end`` joins the thread while the role is None (a polling watcher), not one that serves."""
    release = threading.Event()
    watch = triggers.Watch(("error",), 5.0, 2.0)
    watch.thread = threading.Thread(target=release.wait, daemon=True)
    watch.thread.start()
    watch.take(Role.WAITING)
    watch.end(wait=30)  # returns at once: a serving thread ends with its post mortem
    assert watch.thread.is_alive() and watch.stop.is_set()
    release.set()
    watch.thread.join(30)

