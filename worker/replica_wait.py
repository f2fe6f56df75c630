"""Durable result writes (`cbq worker --redis-wait-replicas N`): after each result write, Redis's `WAIT` until N
replicas have it or the timeout passes, before the worker counts the results as written. Owns that wait, the
check that the write is still on the server that answers, and the log line of a wait that fell short.

Redis replicates asynchronously, so a failover can lose a write the old primary acknowledged (docs/operations.md,
"What a failover can lose"). `WAIT` blocks until the replicas acknowledged every write *of the connection it is
sent on*, and redis-py hands a transaction and the next command to whichever pooled connection is free. So the
wait goes in one pipeline of its own, on one connection: `GET` of the writer's flush marker (set in the result
write's own transaction, `worker.result_writer`), a `PEXPIRE` of the same marker (a write of this connection,
made after the result write on the same server, so the replication offset `WAIT` waits for covers it), then
`WAIT`. A marker below the write's sequence number means the server that answers no longer has the write (a
failover in between): the write stays in doubt and the writer sends it again.

When `WAIT` returns fewer replicas than asked (a replica down or lagging), the worker logs it and carries on:
the results are on the primary and on that many replicas, as without the option; should a failover then lose
them, the orphan sweep or the abandoned-chunk cleanup runs the requests again (`worker.orphans`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import cast

import redis

log = logging.getLogger(__name__)

SHORTFALL_LOG_EVERY_SECONDS = 60.0  # a replica that stays down would otherwise log on every write


@dataclass
class ReplicaWait:
    """Wait for `num_replicas` replicas, at most `timeout_seconds`, after each result write."""

    num_replicas: int
    timeout_seconds: float
    shortfalls: int = field(default=0, init=False)  # writes that reached fewer replicas than asked, in all
    _unlogged_shortfalls: int = field(default=0, init=False)
    _last_logged_at: float = field(default=float("-inf"), init=False)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.timeout_seconds <= 0:  # WAIT's 0 blocks forever: a dead replica would stop the worker
            raise ValueError(f"timeout_seconds must be > 0, got {self.timeout_seconds}")

    @property
    def timeout_ms(self) -> int:
        return max(1, round(self.timeout_seconds * 1000))

    def confirm(self, conn: redis.Redis, marker_key: str, seq: int, marker_ttl_seconds: int) -> bool:
        """After write `seq` (which set `marker_key` to `seq`): wait for the replicas. False when the server
        that answers does not have the write (it must be sent again); True otherwise, whatever the count."""
        with conn.pipeline(transaction=False) as pipe:  # one connection for the three
            pipe.get(marker_key)
            pipe.pexpire(marker_key, marker_ttl_seconds * 1000)
            pipe.wait(self.num_replicas, self.timeout_ms)
            applied, _, acknowledged = pipe.execute()
        if int(cast("bytes | None", applied) or 0) < seq:
            log.warning(
                "result write %d is not on the Redis primary that answers now (a failover lost it); sending it again",
                seq,
            )
            return False
        if int(acknowledged) < self.num_replicas:
            self._shortfall(int(acknowledged))
        return True

    def _shortfall(self, acknowledged: int) -> None:
        self.shortfalls += 1
        self._unlogged_shortfalls += 1
        now = time.monotonic()
        if now - self._last_logged_at < SHORTFALL_LOG_EVERY_SECONDS:
            return
        log.warning(
            "%d result write(s) reached fewer than %d Redis replicas within %.3g s (the last: %d); going on: they "
            "are on the primary, and a failover that loses them makes their requests run again",
            self._unlogged_shortfalls,
            self.num_replicas,
            self.timeout_seconds,
            acknowledged,
        )
        self._unlogged_shortfalls = 0
        self._last_logged_at = now
