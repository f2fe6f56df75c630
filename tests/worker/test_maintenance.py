"""`worker.maintenance.HeartbeatClock`: which chunk executions a worker may take for abandoned (issue 44)."""

from __future__ import annotations

import time

from worker.maintenance import HeartbeatClock


def test_the_cutoff_is_the_last_heartbeat_write_and_holds_after_a_hold_up():
    clock = HeartbeatClock(held_up_after=3, grace_seconds=4)
    now = time.time()
    clock.reset(now - 20)
    assert clock.written(now - 19) is None  # on time
    assert clock.abandoned_before() == now - 19
    # then Redis paused 10 s: the next write is 18 s after the last one
    assert clock.written(now - 1) == 18
    assert clock.abandoned_before() == now - 19  # executions that expired during the pause are spared
    assert clock.written(now) is None
    assert clock.abandoned_before() == now - 19  # within the grace after the hold-up (4 s from now - 1)


def test_the_grace_after_a_hold_up_ends():
    clock = HeartbeatClock(held_up_after=3, grace_seconds=4)
    now = time.time()
    clock.reset(now - 30)
    assert clock.written(now - 10) == 20
    assert clock.written(now - 9) is None
    assert clock.abandoned_before() == now - 9  # the hold-up ended 10 s ago, its grace 6 s ago
