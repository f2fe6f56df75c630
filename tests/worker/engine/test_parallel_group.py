"""A tensor-parallel group's lifecycle on the CPU (gloo, 2 ranks): the control loop runs N steps and
shuts down; a helper that is killed, hangs or fails ends rank 0's run with a clear error within the
collective timeout; SIGTERM or Ctrl-C on rank 0 stops every rank; no process is left behind."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from worker.engine.parallel.group import (
    ParallelState,
    RankFailure,
    all_reduce,
    launch_ranks,
    sum_in_rank_order,
)
from worker.engine.parallel.messages import ControlChannel, RunStep, StepDriver, serve_forever

REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class AddStep:
    """A stand-in for the engine's step description."""

    value: float
    helper_sleep_s: float = 0.0  # > 0: the helper hangs inside the step


@dataclass(frozen=True)
class BigStep(AddStep):
    ids: tuple[int, ...] = ()


class SumRunner:
    """Each rank contributes value * (rank + 1); rank 0 gets the all-reduced sum."""

    def __init__(self, state: ParallelState):
        self.state = state

    def execute_step(self, step: AddStep) -> float:
        if not self.state.is_first_rank:
            time.sleep(step.helper_sleep_s)
        value = step.value + sum(getattr(step, "ids", ()))
        return float(
            all_reduce(self.state, torch.tensor([value * (self.state.rank + 1)], dtype=torch.float64))[0]
        )


def serve_sums(state: ParallelState, expected_steps: int = -1) -> None:
    num_steps = serve_forever(state, SumRunner(state))
    if expected_steps >= 0 and num_steps != expected_steps:
        raise SystemExit(f"rank {state.rank} ran {num_steps} steps, expected {expected_steps}")


def serve_sums_late(state: ParallelState) -> None:
    time.sleep(60)  # hangs before it reads its first message
    serve_forever(state, SumRunner(state))


def rank_values(rank: int, length: int) -> torch.Tensor:
    """Rank `rank`'s first `length` fp32 values, of a magnitude per rank (1e7 to 1e-3), so that the sum's bits
    depend on the order of the adds."""
    scale = (1e7, 1.0, 1e-3, 3e5)[rank % 4]
    return (torch.randn(4096, generator=torch.Generator().manual_seed(rank)) * scale)[:length].float()


class RankOrderRunner:
    """Each rank contributes `rank_values` of the step's length; rank 0 returns `sum_in_rank_order` of them."""

    def __init__(self, state: ParallelState):
        self.state = state

    def execute_step(self, step: AddStep) -> list[float]:
        return sum_in_rank_order(self.state, rank_values(self.state.rank, int(step.value))).tolist()


def serve_rank_order(state: ParallelState) -> None:
    serve_forever(state, RankOrderRunner(state))


def fail_at_start(state: ParallelState) -> None:
    raise RuntimeError("no weights here")


def is_gone(pid: int) -> bool:
    """No such process (a zombie whose parent is gone counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(is_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"processes still alive: {[p for p in pids if not is_gone(p)]}"
        time.sleep(0.05)


def test_control_loop_runs_n_steps_then_shuts_down():
    num_steps = 5
    reported: list[RankFailure] = []
    group = launch_ranks(2, serve_sums, (num_steps,), timeout_s=20, on_failure=reported.append)
    pids = group.helper_pids
    driver = StepDriver(group, SumRunner(group.state))
    sums = [driver.run(AddStep(float(i))) for i in range(num_steps)]
    assert sums == [3.0 * i for i in range(num_steps)]
    driver.shutdown()  # raises if the helper did not exit 0 (e.g. counted another number of steps)
    wait_gone(pids, 5)
    assert reported == [] and group.failure is None, "an exit after Shutdown is not a failure"


def test_sum_in_rank_order_gives_every_element_the_same_bits_at_any_length():
    """--deterministic above two ranks: four ranks' partial sums added in rank order, whatever the message size
    (an all-reduce picks its algorithm, and so the order of the adds, by size)."""
    group = launch_ranks(4, serve_rank_order, (), timeout_s=30)
    driver = StepDriver(group, RankOrderRunner(group.state))
    want = rank_values(0, 4096)
    for rank in (1, 2, 3):
        want = want + rank_values(rank, 4096)
    try:
        for length in (1, 7, 300, 4096):
            got = torch.tensor(driver.run(AddStep(float(length))), dtype=torch.float32)
            assert torch.equal(got, want[:length]), length
    finally:
        driver.shutdown()


def test_a_step_larger_than_one_broadcast_arrives_whole():
    group = launch_ranks(2, serve_sums, (2,), timeout_s=20)
    driver = StepDriver(group, SumRunner(group.state))
    big = BigStep(
        2.0, ids=tuple(range(ControlChannel.FIRST_BYTES))
    )  # its pickle is several broadcasts' worth
    assert driver.run(big) == 6.0 + 3 * sum(big.ids)
    assert driver.run(AddStep(1.0)) == 3.0
    driver.shutdown()


def test_world_size_1_runs_in_process():
    group = launch_ranks(1, serve_sums)
    assert group.helper_pids == []
    driver = StepDriver(group, SumRunner(group.state))
    assert driver.run(AddStep(2.0)) == 2.0
    driver.shutdown()


def test_a_step_must_be_a_frozen_dataclass():
    @dataclass
    class Mutable:
        value: float

    with pytest.raises(TypeError, match="a step must be a frozen dataclass instance, got Mutable"):
        RunStep(Mutable(1.0))  # type: ignore[type-var]
    with pytest.raises(TypeError, match="got dict"):
        RunStep({"value": 1.0})  # type: ignore[type-var]


def test_killed_helper_ends_rank0_run_with_clear_error():
    timeout_s = 20
    reported: list[RankFailure] = []
    group = launch_ranks(2, serve_sums, timeout_s=timeout_s, on_failure=reported.append)
    (pid,) = group.helper_pids
    driver = StepDriver(group, SumRunner(group.state))
    assert driver.run(AddStep(1.0)) == 3.0
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
        while True:  # the step loop carries on until the group fails
            driver.run(AddStep(1.0))
    assert time.monotonic() - start < timeout_s
    assert reported == [group.failure], "the watchdog told the worker (e.g. to stop its loop)"
    group.close()  # already failed: nothing more to report
    wait_gone([pid], 5)


def test_hung_helper_is_bounded_by_the_collective_timeout():
    timeout_s = 3
    group = launch_ranks(2, serve_sums, timeout_s=timeout_s)
    (pid,) = group.helper_pids
    driver = StepDriver(group, SumRunner(group.state))
    start = time.monotonic()
    with pytest.raises(RankFailure, match="the tensor-parallel step failed on rank 0: .*[Tt]imed out"):
        driver.run(AddStep(1.0, helper_sleep_s=60))
    assert timeout_s <= time.monotonic() - start < timeout_s + 10
    with pytest.raises(RankFailure):
        group.check()  # the group is over
    group.close()
    wait_gone([pid], 5)


def test_helper_hung_before_reading_a_message_is_bounded_by_the_collective_timeout():
    """Rank 0's message send waits for its receiver: bounded by the collective timeout too, not held for ever."""
    timeout_s = 3
    group = launch_ranks(2, serve_sums_late, timeout_s=timeout_s)
    (pid,) = group.helper_pids
    driver = StepDriver(group, SumRunner(group.state))
    start = time.monotonic()
    with pytest.raises(RankFailure, match="the tensor-parallel step failed on rank 0: .*[Tt]imed out"):
        driver.run(AddStep(1.0))
    assert timeout_s <= time.monotonic() - start < timeout_s + 10
    group.close()
    wait_gone([pid], 5)


def test_helper_that_fails_is_reported_with_its_exit_code():
    group = launch_ranks(2, fail_at_start, timeout_s=20)
    (pid,) = group.helper_pids
    driver = StepDriver(group, SumRunner(group.state))
    with pytest.raises(RankFailure, match=rf"rank 1 \(pid {pid}\) exited with code 1"):
        for _ in range(200):
            driver.run(AddStep(1.0))
            time.sleep(0.05)
    group.close()
    wait_gone([pid], 5)


RANK0_SCRIPT = """
import time
from worker.engine.parallel.group import launch_ranks
from worker.engine.parallel.messages import StepDriver
from tests.worker.engine.test_parallel_group import AddStep, SumRunner, serve_sums

group = launch_ranks(2, serve_sums, timeout_s=20)
print(*group.helper_pids, flush=True)
driver = StepDriver(group, SumRunner(group.state))
while True:
    driver.run(AddStep(1.0))
    time.sleep(0.01)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_rank0_stops_every_rank(signum):
    rank0 = subprocess.Popen(
        [sys.executable, "-c", RANK0_SCRIPT],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert rank0.stdout is not None
        ready, _, _ = select.select([rank0.stdout], [], [], 60)
        assert ready, "rank 0 did not start its group within 60 s"
        helper_pids = [int(pid) for pid in rank0.stdout.readline().split()]  # the group is up and stepping
        assert len(helper_pids) == 1, "rank 0 did not start its group"
        time.sleep(0.3)
        rank0.send_signal(signum)
        assert rank0.wait(timeout=10) != 0
        wait_gone(helper_pids, 10)
    finally:
        rank0.kill()
        rank0.wait()
