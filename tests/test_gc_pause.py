"""A rank pauses Python's automatic collection from the end of a step's code to the start of the next (the probe
and the reply: a full collection there cost a step 0.2-0.3 s at real size), and only then."""

from __future__ import annotations

import gc
import time

from workbench.rank import control


def test_paused_between_steps_and_resumed_when_the_next_starts():
    assert gc.isenabled()
    try:
        control.in_step("build")
        assert gc.isenabled()  # the user's code runs with collection as before
        control.in_step(None)
        assert not gc.isenabled()  # probe and reply
        assert gc.collect() >= 0  # an explicit collection still runs
        control.in_step("train")
        assert gc.isenabled()
        control.in_step(None)
        time.sleep(control.GC_RESUME_S + 0.5)
        assert gc.isenabled()  # no step came: back on by itself
    finally:
        control.resume_gc()
        gc.enable()


def test_a_users_own_gc_disable_is_left_alone():
    try:
        control.in_step("manual_gc")
        gc.disable()  # the step's own choice (Megatron's manual GC, say)
        control.in_step(None)
        control.in_step("next")
        assert not gc.isenabled()
        control.in_step(None)
        time.sleep(control.GC_RESUME_S + 0.5)
        assert not gc.isenabled()
    finally:
        control.resume_gc()
        gc.enable()
