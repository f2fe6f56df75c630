"""The control messages rank 0 sends the other ranks of a replica, and the loops on both ends.

Owns nothing between calls. Rank 0's `StepDriver.run(step)` broadcasts `RunStep(step)` over the
control group and then runs the same step itself; a helper's `serve_forever` receives each message,
dispatches on its type (isinstance, never a string tag), and runs the step on its shards. Every rank
thus enters the forward's collectives in the same order.

A step is data (`StepDescription`: a frozen dataclass of ids, counts and block ids, no live objects),
so a helper can rebuild everything it needs from the message alone. The engine's real step
description is the engine<->runner seam; anything that executes it satisfies `StepRunner`.

Transport: a pickled message over gloo on loopback, in one broadcast of FIRST_BROADCAST_BYTES (a
second one for what does not fit). Rank 0 waits for its send: 0.3-0.5 ms a broadcast measured on an
overloaded 2-core CPU host, where every thread wake-up is slow; to be measured on the GPU host, and a
shared-memory ring (rank 0 never waits) built only if that shows in the step time. Pickle is safe
here: both ends are ranks of one replica that rank 0 started, over a group on 127.0.0.1; nothing
from the queue is unpickled.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from .group import ParallelState, RankGroup


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


# One broadcast carries a message that fits (a decode step's ids and block tables); a longer one takes
# a second broadcast for the rest. A frame is the pickled length (8 bytes) and then the pickle.
FIRST_BROADCAST_BYTES = 64 * 1024
_LENGTH_BYTES = 8


def broadcast_message(state: ParallelState, message: ControlMessage | None) -> ControlMessage:
    """Rank 0 sends `message`; every other rank passes None and gets rank 0's message back."""
    if state.world_size == 1:
        assert message is not None, "rank 0 of a single-rank group has nothing to receive"
        return message
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group = state.control_group
    first = torch.zeros(FIRST_BROADCAST_BYTES, dtype=torch.uint8)
    if state.is_first_rank:
        assert message is not None, "rank 0 sends a message"
        payload = pickle.dumps(message)
        frame = bytearray(len(payload).to_bytes(_LENGTH_BYTES, "little") + payload)
        first[: min(len(frame), FIRST_BROADCAST_BYTES)] = torch.frombuffer(
            frame[:FIRST_BROADCAST_BYTES], dtype=torch.uint8
        )
        group.broadcast([first], opts).wait()
        if len(frame) > FIRST_BROADCAST_BYTES:
            group.broadcast([torch.frombuffer(frame[FIRST_BROADCAST_BYTES:], dtype=torch.uint8)], opts).wait()
        return message
    assert message is None, "only rank 0 sends"
    group.broadcast([first], opts).wait()
    frame = first.numpy().tobytes()
    frame_len = _LENGTH_BYTES + int.from_bytes(frame[:_LENGTH_BYTES], "little")
    if frame_len > FIRST_BROADCAST_BYTES:
        rest = torch.empty(frame_len - FIRST_BROADCAST_BYTES, dtype=torch.uint8)
        group.broadcast([rest], opts).wait()
        frame += rest.numpy().tobytes()
    received = pickle.loads(frame[_LENGTH_BYTES:frame_len])
    assert isinstance(received, RunStep | Shutdown), f"unexpected control message {type(received).__name__}"
    return received


def serve_forever(state: ParallelState, runner: StepRunner) -> int:
    """A helper rank's loop: run every step rank 0 sends until Shutdown. Returns the number of steps."""
    assert not state.is_first_rank, "rank 0 drives the steps (StepDriver); it does not serve them"
    num_steps = 0
    while True:
        message = broadcast_message(state, None)
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

    def run(self, step: StepT) -> object:
        """Run `step` on every rank; returns rank 0's result (e.g. the gathered logits' samples)."""
        self.group.check()
        try:
            broadcast_message(self.group.state, RunStep(step))
            return self.runner.execute_step(step)
        except Exception as error:  # whatever it was, the ranks are out of step: the group is over
            raise self.group.failure_after(error) from error

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell every helper to leave its loop, then wait for them (RankGroup.close)."""
        if self.group.failure is None:
            try:
                broadcast_message(self.group.state, Shutdown())
            except RuntimeError:
                pass  # a helper already gone: close() reports how it ended
        self.group.close(timeout_s)
