"""The control messages rank 0 sends the other ranks of a replica, and the loops on both ends.

Owns each rank's ControlChannel (its reused frame buffers). Rank 0's `StepDriver.run(step)` broadcasts `RunStep(step)` over the
control group and then runs the same step itself; a helper's `serve_forever` receives each message,
dispatches on its type (isinstance, never a string tag), and runs the step on its shards. Every rank
thus enters the forward's collectives in the same order.

A step is data (`StepDescription`: a frozen dataclass of ids, counts and block ids, no live objects),
so a helper can rebuild everything it needs from the message alone. The engine's real step
description is the engine<->runner seam; anything that executes it satisfies `StepRunner`.

Transport: a pickled message over gloo on loopback (ControlChannel), in one broadcast of 64 KiB (a
second one for what does not fit). Rank 0 waits for its send: 0.05-0.7 ms a step measured on an
overloaded 2-core CPU host, where every thread wake-up is slow; to be measured on the GPU host, and a
shared-memory ring (rank 0 never waits) built only if that shows in the step time. Pickle is safe
here: both ends are ranks of one replica that rank 0 started, over a group on 127.0.0.1; nothing
from the queue is unpickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from .group import ParallelState, RankGroup, broadcast_from_first, min_over_ranks


class StepDescription(Protocol):
    """What a step must be to cross processes: a (frozen) dataclass instance, i.e. data."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


StepT = TypeVar("StepT", bound=StepDescription)
StepT_contra = TypeVar("StepT_contra", bound=StepDescription, contravariant=True)


class StepRunner(Protocol[StepT_contra]):
    """What runs a step on one rank: the model runner with that rank's shards."""

    def execute_step(self, step: StepT_contra) -> object: ...


@dataclass(frozen=True)
class RunStep(Generic[StepT]):
    """Run this step's forward on your shards."""

    step: StepT

    def __post_init__(self):
        params = getattr(type(self.step), "__dataclass_params__", None)
        if not dataclasses.is_dataclass(self.step) or params is None or not params.frozen:
            raise TypeError(f"a step must be a frozen dataclass instance, got {type(self.step).__name__}")


@dataclass(frozen=True)
class Shutdown:
    """Leave the loop; the process then exits."""


ControlMessage = RunStep | Shutdown


class ControlChannel:
    """One rank's end of the control group. Owns the frame buffers, which live as long as the channel:
    gloo takes ~10 ms longer for a broadcast into a freshly allocated tensor than into a reused one.

    A frame is the pickle's length (8 bytes) then the pickle. Its first FIRST_BYTES go in one
    broadcast (a decode step's ids and block tables fit); a longer frame's rest takes a second."""

    FIRST_BYTES = 64 * 1024
    LENGTH_BYTES = 8

    def __init__(self, state: ParallelState):
        self.state = state
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0
        self._first = torch.zeros(self.FIRST_BYTES, dtype=torch.uint8)
        self._rest = torch.zeros(0, dtype=torch.uint8)  # grown to a power of two when needed

    def _broadcast(self, buffer: torch.Tensor) -> None:
        work = self.state.control_group.broadcast([buffer], self._opts)
        if self.state.is_first_rank:
            # NOTE: a send can wait for its receiver (gloo); bounded, as a collective is, so that a helper that
            # hangs before reading the message ends the step with an error instead of holding rank 0 for ever.
            work.wait(datetime.timedelta(seconds=self.state.timeout_s))
        else:
            work.wait()  # a helper waits as long as rank 0 is idle

    def _rest_view(self, num_bytes: int) -> torch.Tensor:
        if self._rest.numel() < num_bytes:
            self._rest = torch.zeros(1 << (num_bytes - 1).bit_length(), dtype=torch.uint8)
        return self._rest[:num_bytes]

    def send(self, message: ControlMessage) -> None:
        """Rank 0: every other rank's `receive` returns `message`."""
        assert self.state.is_first_rank, "only rank 0 sends"
        if self.state.world_size == 1:
            return
        payload = pickle.dumps(message)
        frame = torch.frombuffer(
            bytearray(len(payload).to_bytes(self.LENGTH_BYTES, "little") + payload), dtype=torch.uint8
        )
        num_first = min(frame.numel(), self.FIRST_BYTES)
        self._first[:num_first] = frame[:num_first]
        self._broadcast(self._first)
        if frame.numel() > self.FIRST_BYTES:
            rest = self._rest_view(frame.numel() - self.FIRST_BYTES)
            rest.copy_(frame[self.FIRST_BYTES :])
            self._broadcast(rest)

    def receive(self) -> ControlMessage:
        """Ranks other than 0: rank 0's next message."""
        assert not self.state.is_first_rank, "rank 0 sends"
        self._broadcast(self._first)
        frame = self._first.numpy().tobytes()
        frame_len = self.LENGTH_BYTES + int.from_bytes(frame[: self.LENGTH_BYTES], "little")
        if frame_len > self.FIRST_BYTES:
            rest = self._rest_view(frame_len - self.FIRST_BYTES)
            self._broadcast(rest)
            frame += rest.numpy().tobytes()
        received = pickle.loads(frame[self.LENGTH_BYTES : frame_len])
        assert isinstance(received, RunStep | Shutdown), (
            f"unexpected control message {type(received).__name__}"
        )
        return received


def serve_forever(state: ParallelState, runner: StepRunner) -> int:
    """A helper rank's loop: run every step rank 0 sends until Shutdown. Returns the number of steps."""
    channel = ControlChannel(state)
    num_steps = 0
    while True:
        message = channel.receive()
        if isinstance(message, Shutdown):
            return num_steps
        if isinstance(message, RunStep):
            runner.execute_step(message.step)
            num_steps += 1
        else:  # unreachable while ControlMessage has two members; a new one must be handled above
            raise TypeError(f"no handler for {type(message).__name__}")


class StepDriver(Generic[StepT]):
    """Rank 0's end: each step goes to every helper, then runs here. A step that fails (a helper died,
    or hung past the collective timeout, or rank 0's forward raised) ends the group and is raised as
    its RankFailure: the helper's death when there was one, whatever the backend said."""

    def __init__(self, group: RankGroup, runner: StepRunner[StepT]):
        self.group = group
        self.runner = runner
        self.channel = ControlChannel(group.state)

    def run(self, step: StepT) -> object:
        """Run `step` on every rank; returns rank 0's result (e.g. the gathered logits' samples)."""
        self.group.check()
        try:
            self.channel.send(RunStep(step))
            return self.runner.execute_step(step)
        except Exception as error:  # whatever it was, the ranks are out of step: the group is over
            raise self.group.failure_after(error) from error

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell every helper to leave its loop, then wait for them (RankGroup.close)."""
        self.group.stop_watching()  # the helpers' exits that follow are the point, not a failure
        if self.group.failure is None:
            try:
                self.channel.send(Shutdown())
            except RuntimeError:
                pass  # a helper already gone: close() reports how it ended
        self.group.close(timeout_s)


class Replica:
    """One rank's part in a tensor-parallel replica, as its model runner reads it (data, not a subclass): its
    `ParallelState`, its control channel and, on rank 0, the `RankGroup`. Rank 0 sends each step before running
    it and alone samples; in async mode its samples are broadcast to every rank, whose next step's carry-over
    rows read them. `measured`: the KV cache's size came from each rank's free memory (not --num-kv-blocks), so
    it is measured again after the build and agreed over the ranks."""

    def __init__(self, state: ParallelState, group: RankGroup | None, *, measured: bool, shares_samples: bool):
        assert (group is not None) == state.is_first_rank, "rank 0 holds the group"
        self.state = state
        self.group = group
        self.measured = measured
        self.shares_samples = shares_samples and state.world_size > 1
        self.channel = ControlChannel(state)

    @property
    def samples(self) -> bool:
        """Whether this rank samples (rank 0): a helper's logits are its vocabulary part."""
        return self.state.is_first_rank

    def agree_num_kv_blocks(self, num_kv_blocks: int) -> int:
        """Every rank's least: a block id names the same block on every rank."""
        return min_over_ranks(self.state, num_kv_blocks)

    def check(self) -> None:
        """Rank 0: raise the group's RankFailure if a helper is gone (before a step goes out)."""
        if self.group is not None:
            self.group.check()

    def send_step(self, step: StepDescription) -> None:
        """Rank 0: the step (known to build) goes to every helper; a helper runs what it received."""
        if self.group is not None:
            self.channel.send(RunStep(step))

    @contextlib.contextmanager
    def in_step(self) -> Iterator[None]:
        """Rank 0: a failure inside a step that went out leaves the ranks out of step, so it ends the group and is
        raised as the group's RankFailure. A helper's failure is its own (rank 0 sees it through the group)."""
        if self.group is None:
            yield
            return
        try:
            yield
        except Exception as error:
            raise self.group.failure_after(error) from error

    def share_samples(self, sampled: torch.Tensor) -> None:
        """Async mode: rank 0's sampled ids into every rank's `sampled` (in place)."""
        if self.shares_samples:
            broadcast_from_first(self.state, sampled)

    def close(self) -> None:
        """Rank 0: tell the helpers to stop and wait for them."""
        if self.group is None:
            return
        self.group.stop_watching()
        if self.group.failure is None:
            try:
                self.channel.send(Shutdown())
            except RuntimeError:
                pass  # a helper already gone: close() reports how it ended
        self.group.close()
