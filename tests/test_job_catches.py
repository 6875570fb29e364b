"""Catch narrowly, say the fault (issue 63): the capture's code inside a user's job (``job/triggers.py``,
``job/engine.py``) catches the failures it knows (a store's ``RuntimeError``, a file's ``OSError``) where it
can go on, and leaves a bug of its own to the one broad catch at the boundary, which says it on stderr once
rather than swallowing it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from workbench.job import engine, triggers


class BrokenStore:
    """A store whose every call raises ``exc``."""

    def __init__(self, exc: BaseException):
        self.exc = exc
        self.calls = 0

    def _fail(self, *args, **kwargs):
        self.calls += 1
        raise self.exc

    check = get = set = add = wait = _fail


def _cap(tmp_path, rank=0, world=2):
    return SimpleNamespace(rank=rank, world_size=world, root=str(tmp_path), attempt=0, closed=False, ledger_path=None,
                           job_excepthook=None, open_calls=lambda: [], watch_flight_recorder=lambda s: 0)


@pytest.mark.parametrize("exc", [RuntimeError("Connection reset by peer"), ConnectionResetError(104, "reset")])
def test_a_stores_own_errors_are_storedown(exc):
    store = BrokenStore(exc)
    for call in (lambda: triggers._has(store, "k"), lambda: triggers._set(store, "k", "v"),
                 lambda: triggers._claim(store, triggers._key(_cap(None)), {"reason": "error"})):
        with pytest.raises(triggers.StoreDown) as got:
            call()
        assert got.value.cause is exc


def test_a_bug_is_not_taken_for_a_store_that_is_down():
    """A ``TypeError`` (a bug of ours, a store object of the wrong kind) is no store failure: it is not counted as
    one, it goes up to the watcher's boundary, which says it."""
    store = BrokenStore(TypeError("check() takes a list"))
    with pytest.raises(TypeError):
        triggers._has(store, "k")
    with pytest.raises(TypeError):
        triggers._set(store, "k", "v")


def test_the_watchers_boundary_says_a_bug_once_and_stops(tmp_path, monkeypatch, capfd):
    store = BrokenStore(TypeError("check() takes a list"))
    monkeypatch.setattr(engine, "job_store", lambda: store)
    watch = triggers.install(_cap(tmp_path, rank=1), ("error",), 5.0, 2.0, poll=0.01)
    try:
        watch.thread.join(30)
        assert not watch.thread.is_alive(), "the watcher went on past a bug of its own"
    finally:
        watch.end()
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("workbench:")]
    assert said == ["workbench: rank 1's post-mortem watcher stopped: TypeError: check() takes a list"], err
    assert "Traceback" not in err
    assert store.calls == 1


def test_open_calls_a_store_will_not_take_are_counted_as_its_failure(tmp_path):
    """``_poll`` publishing a rank's open calls to a store that fails: ``StoreDown`` for the watcher to count (a
    store that stays down is said, ``_store_lost``), not a silent skip."""

    class NoWrites(BrokenStore):  # reads answer (no trigger yet), writes fail
        def check(self, keys):
            return False

    store = NoWrites(RuntimeError("Broken pipe"))
    tail = SimpleNamespace(poll=lambda: None, calls=lambda: [])
    with pytest.raises(triggers.StoreDown):
        triggers._poll(_cap(tmp_path, rank=1), triggers.Watch(("deadlock",), 5.0, 2.0), store,
                       triggers._key(_cap(tmp_path)), tail, {"published": None})
    assert store.calls == 1


def test_teardown_steps_each_run_whatever_the_one_before_raised():
    ran = []

    def fails():
        ran.append("fails")
        raise AttributeError("no such socket")

    engine._quietly(fails, lambda: ran.append("next"), lambda: 1 / 0, lambda: ran.append("last"))
    assert ran == ["fails", "next", "last"]


def test_quietly_does_not_take_an_interrupt():
    """Cleanup is broad for ``Exception`` only: Ctrl-C during a teardown still ends the wait."""
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine._quietly(interrupted)


def test_the_all_done_wait_says_a_store_that_fails(monkeypatch, capfd):
    store = BrokenStore(RuntimeError("Connection refused"))
    monkeypatch.setattr(engine, "job_store", lambda: store)
    engine._all_done(triggers._key(_cap(None)), 1, timeout=0.1)
    err = capfd.readouterr().err
    assert "the breakpoint's end could not be agreed through the job's store (RuntimeError: Connection refused)" \
        in err, err
