"""The ledger mirror: what a step's frame and diagnosis read holds every remote rank's calls.

The namespace tests (test_multihost.py) run it across simulated hosts; here the one rule that a
loaded CI box broke: a remote rank whose control thread missed a round trip during the step was
left out of the reads for a while, and the read right after the step (the frame's, the
diagnosis's) then lacked that rank's calls, which read as "rank 2 never issued ..." .
"""

from __future__ import annotations

import base64
from types import SimpleNamespace

from workbench.live import mirror
from workbench.rank import control

ROWS = b'{"seq": 1, "op": "broadcast"}\n'


def _setup(tmp_path, monkeypatch, replies):
    asked: list[float] = []

    def ask(where, cmd, timeout=3.0, **args):
        asked.append(timeout)
        return next(replies, {"data": ""})

    monkeypatch.setattr(control, "ask", ask)
    cluster = SimpleNamespace(world_size=2, is_local=lambda r: r == 0, controls={1: {"host": "hostb"}})
    session = SimpleNamespace(ledger_dir=str(tmp_path), stepping=True, steps_begun=1,
                              _ledger_reader=SimpleNamespace(poll=lambda: 0))
    mirror.mirror_before_poll(cluster, session)
    return session, asked


def test_a_remote_rank_that_missed_a_poll_in_the_step_is_read_once_the_step_ends(tmp_path, monkeypatch):
    replies = iter([{"error": "TimeoutError: timed out"}, {"data": base64.b64encode(ROWS).decode()}])
    session, asked = _setup(tmp_path, monkeypatch, replies)
    session._ledger_reader.poll()  # mid-step, on a loaded box: rank 1's control thread misses its round trip
    session._ledger_reader.poll()  # still mid-step: left out a while (polls come every few hundred ms)
    assert asked == [mirror.ASK_S]
    session.stepping = False
    session._ledger_reader.poll()  # the step ended: the read the frame and the diagnosis make
    assert (tmp_path / "rank1.jsonl").read_bytes() == ROWS
    assert asked[1] == mirror.SETTLE_S


def test_a_host_gone_costs_one_settling_wait_a_step_not_one_a_read(tmp_path, monkeypatch):
    replies = iter([{"error": "OSError: unreachable"}] * 10)
    session, asked = _setup(tmp_path, monkeypatch, replies)
    session.stepping = False
    for _ in range(3):
        session._ledger_reader.poll()
    assert asked == [mirror.SETTLE_S]
    session.steps_begun += 1  # the next step: asked again once it ends
    session._ledger_reader.poll()
    assert asked == [mirror.SETTLE_S] * 2
