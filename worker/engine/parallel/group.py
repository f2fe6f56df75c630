"""The process group of one model replica: its ranks, their collectives, and their lifetimes.

Owns, on rank 0 (the caller), the helper processes and the watchdog that watches them (`RankGroup`);
on every rank, that rank's `ParallelState` (its rank, the world size, and its two process groups).
Nothing here is global: torch.distributed's default group is never initialised, the groups are
backend objects built from one TCPStore and passed explicitly inside `ParallelState`.

Two groups per replica:
- `group`, for the forward's collectives (NCCL on CUDA, gloo on the CPU), bounded by the collective
  timeout: a rank that hangs inside a forward ends the step with an error after `timeout_s`.
- `control_group`, gloo over loopback, for rank 0's per-step messages (messages.py). Its timeout is
  effectively infinite because a helper waits there while rank 0 is idle (an empty queue may last
  hours); a helper is never stranded there since it exits when rank 0's process dies (below).
  Keeping control off the NCCL group also keeps the pickled message off the GPU.

Lifetimes:
- Helpers are started with torch.multiprocessing's spawn context (never fork: CUDA may be running in
  the caller). Each helper ignores SIGINT (Ctrl-C reaches the whole terminal process group; rank 0
  alone decides) and runs a thread that exits the process when its parent changes, which is how
  SIGTERM or SIGKILL on rank 0 stops every rank. (Not PR_SET_PDEATHSIG: it fires when the parent
  *thread* ends, and rank 0 may start the group from a loader thread.)
- Rank 0's watchdog thread polls the helpers' exit codes. A helper that exits before
  `stop_watching()` (the driver calls it before its Shutdown message) is a failure: it is recorded as a `RankFailure` that names the rank, its pid and its exit code or signal,
  the other helpers are killed so the group cannot half-run, and `on_failure` is called. Rank 0's
  next collective then fails at once (gloo: connection closed) or after the timeout (NCCL), and the
  step driver (messages.py) raises the recorded failure instead of the backend's message.
- `close()` joins the helpers (after the driver's Shutdown message), then terminates and kills what is
  left, so no process outlives the group; an exit of rank 0 without it (an exception, Ctrl-C) closes
  at once through atexit.
- Everything listens on 127.0.0.1 only: the TCPStore (through a socket bound here) and gloo's pairs.
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 60.0
# Control messages wait as long as rank 0 is idle; gloo needs a finite number.
CONTROL_TIMEOUT = datetime.timedelta(days=3650)
LOOPBACK = "127.0.0.1"
EXIT_PARENT_GONE = 3  # a helper's exit code when rank 0's process went away
_POLL_S = 0.1


class RankFailure(RuntimeError):
    """A rank of the group died, hung past the collective timeout, or failed to start."""


@dataclass(frozen=True)
class ParallelState:
    """One rank's place in its replica. `group`/`control_group` are None when world_size is 1: the
    layers then run without any collective, so one model file serves every world size."""

    rank: int
    world_size: int
    device: torch.device
    group: Any = None  # a torch.distributed Backend (ProcessGroupGloo or ProcessGroupNCCL)
    control_group: Any = None  # ProcessGroupGloo, for messages.py
    # The collective timeout (the forward group's); rank 0's control messages are bounded by it too, so that a
    # helper that hangs before it reads the next message cannot hold rank 0 (messages.py).
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self):
        assert 0 <= self.rank < self.world_size, f"rank {self.rank} outside world_size {self.world_size}"
        assert (self.group is None) == (self.world_size == 1), "a group exactly when world_size > 1"

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        """The state of a model that is not split (TP=1)."""
        return cls(rank=0, world_size=1, device=torch.device(device))


# --- collectives: no-ops at world_size 1 -----------------------------------------------------------
# NOTE: gloo's CUDA support varies by collective and build; with gloo over CUDA tensors (several ranks on one
# GPU, in tests) each collective runs on a host copy instead (`_host_staged`).


def _host_staged(state: ParallelState, x: torch.Tensor) -> bool:
    return x.is_cuda and isinstance(state.group, dist.ProcessGroupGloo)


def all_reduce(state: ParallelState, x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks, in place; returns `x`."""
    if state.world_size > 1:
        if _host_staged(state, x):
            return x.copy_(all_reduce(state, x.cpu()))
        state.group.allreduce([x]).wait()
    return x


def min_over_ranks(state: ParallelState, value: int) -> int:
    """The least of every rank's `value` (over the control group: host ints, whatever the device)."""
    if state.world_size == 1:
        return value
    counts = torch.tensor([value], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # the stubs type the member, not the op
    state.control_group.allreduce([counts], opts).wait()
    return int(counts.item())


def sum_in_rank_order(state: ParallelState, x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks, added in rank order (rank 0's, plus rank 1's, ...) on every rank: each element's
    bits depend only on the ranks' values, never on the message size. An all-reduce picks its algorithm, and so the
    order of a sum of three or more values, by the message size (the step's token count): `--deterministic` above
    two ranks sums this way, at the cost of an all-gather of every rank's partial instead of an all-reduce."""
    if state.world_size <= 2:  # a + b: the same bits in either order
        return all_reduce(state, x)
    parts = all_gather(state, x[None], dim=0)  # [N, ...]: every rank's partial, in rank order
    total = parts[0]
    for part in parts[1:]:
        total += part  # element-wise, one rounding per add, in rank order
    return x.copy_(total)


def all_gather(state: ParallelState, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order, on every rank."""
    if state.world_size == 1:
        return x
    if _host_staged(state, x):
        return all_gather(state, x.cpu(), dim).to(x.device)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.world_size)]
    state.group.allgather([parts], [x]).wait()
    return torch.cat(parts, dim=dim)


def broadcast_from_first(state: ParallelState, x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank, in place; returns `x`."""
    if state.world_size > 1:
        if _host_staged(state, x):
            return x.copy_(broadcast_from_first(state, x.cpu()))
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        state.group.broadcast([x], opts).wait()
    return x


def gather_to_first(state: ParallelState, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Every rank's `x` concatenated along `dim` on rank 0; None on the other ranks."""
    if state.world_size == 1:
        return x
    if _host_staged(state, x):
        gathered = gather_to_first(state, x.cpu(), dim)
        return None if gathered is None else gathered.to(x.device)
    x = x.contiguous()
    opts = dist.GatherOptions()
    opts.rootRank = 0
    if not state.is_first_rank:
        state.group.gather([], [x], opts).wait()
        return None
    parts = [torch.empty_like(x) for _ in range(state.world_size)]
    state.group.gather([parts], [x], opts).wait()
    return torch.cat(parts, dim=dim)


# --- building the groups (every rank) ---------------------------------------------------------------


def _connect(
    store, rank: int, world_size: int, device: torch.device, timeout_s: float, backend: str | None = None
) -> ParallelState:
    timeout = datetime.timedelta(seconds=timeout_s)
    group: Any
    if (backend or default_backend(device.type)) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(dist.PrefixStore("forward", store), rank, world_size, opts)
    else:
        group = _loopback_gloo(dist.PrefixStore("forward", store), rank, world_size, timeout)
    control = _loopback_gloo(dist.PrefixStore("control", store), rank, world_size, CONTROL_TIMEOUT)
    return ParallelState(rank, world_size, device, group, control, timeout_s)


def _loopback_gloo(store, rank: int, world_size: int, timeout: datetime.timedelta):
    """A gloo group on 127.0.0.1: the ranks share a host, and nothing off the host can reach it
    (gloo's default device is the hostname's address, which may not even resolve in a container)."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the only way to pick the device
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def default_backend(device_type: str) -> str:
    """NCCL on CUDA, gloo on the CPU. Gloo also runs CUDA tensors (through the host), which lets several
    ranks share one GPU in the tests, where NCCL refuses two ranks on one device."""
    return "nccl" if device_type == "cuda" else "gloo"


def _rank_device(device_type: str, rank: int, device_ids: Sequence[int] | None) -> torch.device:
    if device_type != "cuda":
        return torch.device(device_type)
    return torch.device("cuda", device_ids[rank] if device_ids is not None else rank)


def _exit_when_parent_changes(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(EXIT_PARENT_GONE)  # no cleanup: the group is gone, nothing here is worth saving
        time.sleep(_POLL_S)


def _helper_main(
    rank: int,
    world_size: int,
    port: int,
    parent_pid: int,
    device_type: str,
    device_ids: Sequence[int] | None,
    timeout_s: float,
    target: Callable[..., object],
    args: tuple,
    backend: str | None = None,
) -> None:
    """A helper rank's whole life: watch the parent, join the group, run `target(state, *args)`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_parent_changes, args=(parent_pid,), daemon=True).start()
    device = _rank_device(device_type, rank, device_ids)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=CONTROL_TIMEOUT)
    store.set(f"ready/{rank}", "1")
    state = _connect(store, rank, world_size, device, timeout_s, backend)
    target(state, *args)  # an exception exits non-zero with its traceback on stderr (multiprocessing)
    # Done (rank 0 sent Shutdown): leave without tearing the process groups down. Their C++ destructors race rank 0's
    # own teardown and can abort this process from a still-joinable thread ("terminate called without an active
    # exception": SIGABRT, about one run in three of the latent-attention TP tests), which rank 0 then reports as a
    # failed rank. Nothing here needs saving: the step results went to rank 0, and stdio is flushed first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- rank 0 ------------------------------------------------------------------------------------------


def describe_exit(rank: int, pid: int | None, exitcode: int) -> str:
    if exitcode < 0:
        return f"rank {rank} (pid {pid}) was killed by {signal.Signals(-exitcode).name}"
    if exitcode == EXIT_PARENT_GONE:
        return f"rank {rank} (pid {pid}) exited because rank 0's process went away"
    return f"rank {rank} (pid {pid}) exited with code {exitcode} (its error, if any, is above on stderr)"


class RankGroup:
    """Rank 0's handle on the replica: its own `state`, the helpers, and the watchdog."""

    def __init__(self, state: ParallelState, processes: list, store, on_failure):
        self.state = state
        self._processes = processes  # helper i is rank i + 1
        self._store = store  # kept alive: the TCPStore server lives in this process
        self._on_failure = on_failure
        self._failure: RankFailure | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()  # set: helpers may exit without it being a failure
        self._closed = False
        self._watchdog = threading.Thread(target=self._watch, name="rank-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self._close_at_exit)

    @property
    def helper_pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    @property
    def failure(self) -> RankFailure | None:
        return self._failure

    def check(self) -> None:
        """Raise the recorded failure, if a helper died."""
        if self._failure is not None:
            raise self._failure

    def failure_after(self, error: BaseException, wait_s: float = 2.0) -> RankFailure:
        """The failure to raise after a step failed on rank 0 with `error`, which ends the group (its
        ranks are out of step now): a helper's death when there was one (the watchdog may need a
        moment to see its exit code), otherwise `error` itself: a collective that timed out because a
        helper hangs, a broken connection, or an error of rank 0's own forward."""
        deadline = time.monotonic() + wait_s
        while self._failure is None and time.monotonic() < deadline:
            self._poll_once()
            time.sleep(_POLL_S / 4)
        with self._lock:
            if self._failure is None:
                self._failure = RankFailure(f"the tensor-parallel step failed on rank 0: {error}")
        self._kill_helpers()
        return self._failure

    def _poll_once(self) -> None:
        with self._lock:
            if self._failure is not None or self._closing.is_set():
                return
            for rank, process in enumerate(self._processes, start=1):
                if process.exitcode is not None:
                    self._failure = RankFailure(
                        describe_exit(rank, process.pid, process.exitcode)
                        + "; the tensor-parallel group is ended"
                    )
                    break
            else:
                return
        self._kill_helpers()
        if self._on_failure is not None:
            self._on_failure(self._failure)

    def _watch(self) -> None:
        while not self._closing.is_set() and self._failure is None:
            self._poll_once()
            self._closing.wait(_POLL_S)

    def _kill_helpers(self) -> None:
        for process in self._processes:
            if process.exitcode is None:
                process.kill()
        for process in self._processes:
            process.join(timeout=5)

    def stop_watching(self) -> None:
        """From now on a helper's exit is expected (a Shutdown is on its way), not a failure."""
        self._closing.set()
        self._watchdog.join(timeout=1)  # then only the closing thread reaps the helpers

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait up to `timeout_s` for the helpers to exit (send Shutdown first), then end the rest.
        Raises RankFailure when a helper exited non-zero on its own and no failure was raised before."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self._close_at_exit)
        self.stop_watching()
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        ended_by_close = [p for p in self._processes if p.exitcode is None]
        for process in ended_by_close:
            process.terminate()
            process.join(timeout=2)
        self._kill_helpers()
        self._shut_groups()
        failed = [
            describe_exit(rank, p.pid, p.exitcode)
            for rank, p in enumerate(self._processes, start=1)
            if p not in ended_by_close and p.exitcode != 0
        ]
        if self._failure is None and failed:
            self._failure = RankFailure("; ".join(failed))
            raise self._failure

    def _shut_groups(self) -> None:
        """Free the backends' resources (NCCL communicators) now that every helper is gone."""
        for group in (self.state.group, self.state.control_group):
            shutdown = getattr(group, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except RuntimeError:
                    pass  # a backend whose peers died may refuse; the process frees it at exit
        self._store = None

    def _close_at_exit(self) -> None:
        """Rank 0 is exiting without having shut the group down (an exception, Ctrl-C): the helpers
        wait for a message that will not come, so end them now."""
        try:
            self.close(timeout_s=0.0)
        except RankFailure:
            pass  # exiting anyway; the helpers are gone

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close(timeout_s=10.0 if exc[0] is None else 0.0)


def launch_ranks(
    world_size: int,
    target: Callable[..., object],
    args: tuple = (),
    *,
    device_type: str = "cpu",
    device_ids: Sequence[int] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_timeout_s: float = 120.0,
    on_failure: Callable[[RankFailure], None] | None = None,
    backend: str | None = None,
) -> RankGroup:
    """Start ranks 1..world_size-1 as spawned processes running `target(state, *args)` (a picklable,
    module-level callable, typically building the model's shards and calling messages.serve_forever),
    join them with the caller as rank 0, and return rank 0's RankGroup.

    `timeout_s` bounds every forward collective; `start_timeout_s` bounds the helpers' start-up
    (importing torch and reaching the store). `on_failure` is called from the watchdog thread when a
    helper dies (e.g. to stop the worker's loop); the failure is raised on rank 0 in any case.
    `backend`: the forward group's, "nccl" or "gloo" (None: `default_backend`); `device_ids` may then name
    one GPU for several ranks (gloo only)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"backend must be nccl or gloo, got {backend!r}")
    if device_type == "cuda" and device_ids is None and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"tensor parallel size {world_size} needs {world_size} GPUs; {torch.cuda.device_count()} visible"
        )
    device = _rank_device(device_type, 0, device_ids)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds rank 0's communicator to the current device
    if world_size == 1:
        return RankGroup(ParallelState(0, 1, device), [], None, on_failure)
    # The store listens on a socket bound here: loopback only (TCPStore alone listens on every
    # interface), on a port the OS picked free (no race with another group). The store owns the
    # socket once it has its fd, and closes it.
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(128)
    store = dist.TCPStore(
        LOOPBACK, listener.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
        timeout=CONTROL_TIMEOUT, master_listen_fd=listener.detach(),
    )  # fmt: skip
    ctx = mp.get_context("spawn")
    processes = []
    for rank in range(1, world_size):
        helper_args = (
            rank,
            world_size,
            store.port,
            os.getpid(),
            device_type,
            device_ids,
            timeout_s,
            target,
            args,
            backend,
        )
        process = ctx.Process(target=_helper_main, args=helper_args, name=f"cbq-rank{rank}", daemon=True)
        process.start()
        processes.append(process)
    try:
        _wait_for_helpers(store, processes, start_timeout_s)
        state = _connect(store, 0, world_size, device, timeout_s, backend)
    except BaseException:
        for process in processes:
            process.kill()
            process.join(timeout=5)
        raise
    return RankGroup(state, processes, store, on_failure)


def _wait_for_helpers(store, processes: list, start_timeout_s: float) -> None:
    """Block until every helper reached the store, failing fast (with its exit code) if one dies."""
    deadline = time.monotonic() + start_timeout_s
    for rank, process in enumerate(processes, start=1):
        while not store.check([f"ready/{rank}"]):
            if process.exitcode is not None:
                raise RankFailure(describe_exit(rank, process.pid, process.exitcode) + " while starting")
            if time.monotonic() > deadline:
                raise RankFailure(
                    f"rank {rank} (pid {process.pid}) did not start within {start_timeout_s:.0f} s"
                )
            time.sleep(_POLL_S)
