"""The store marker: one key that says this Redis still holds what cbq wrote to it. Owns `cbq:store`.

A Redis restarted without persistence (or flushed, or failed over to an empty replica) loses every key at
once; then every batch reads as never submitted, and every chunk in flight as taken over by someone else.
The marker (an id and the time it was made) is set, if absent, in the transaction of every submit, and by a
worker that starts on a store holding batches (one written before the marker existed), so a store that holds
any batch holds it. Its absence while a batch id is known, or a different id than a process saw before,
means the data were lost: `cbq status` and the workers say so in one line (`wiped_line`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import redis

from schemas import keys


def wiped_line(batch_id: str) -> str:
    return f"the Redis store was wiped (no cbq marker): batch {batch_id}'s records are gone"


def mark(pipe: Any) -> None:
    """Set the marker if absent, in the caller's pipeline or transaction (submit's commit)."""
    pipe.set(keys.STORE_MARKER, f"{uuid.uuid4().hex}@{time.time():.0f}", nx=True)


def read_marker(conn: redis.Redis) -> str | None:
    raw = conn.get(keys.STORE_MARKER)
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def is_wiped(conn: redis.Redis) -> bool:
    """Whether the store lacks the marker (asked once a batch id is known and its keys are missing)."""
    return read_marker(conn) is None


class MarkerWatch:
    """The marker as one process last saw it: `wiped()` says whether it went away, or was made anew, since."""

    def __init__(self, conn: redis.Redis):
        self.conn = conn
        self.seen: str | None = None

    def start(self) -> None:
        """Read the marker; on a store that holds batches and no marker (written before it existed), set it."""
        if read_marker(self.conn) is None and self.conn.exists(keys.BATCHES):
            with self.conn.pipeline(transaction=True) as pipe:
                mark(pipe)
                pipe.execute()
        self.seen = read_marker(self.conn)

    def wiped(self) -> bool:
        current = read_marker(self.conn)
        lost = self.seen is not None and current != self.seen
        if current is not None:
            self.seen = current  # a new store from now on: what was lost is reported once
        return lost
