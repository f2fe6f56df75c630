"""`cbq run`'s journal: every result of a run, appended to a file beside its output as soon as the in-process
worker has it, so a run killed at any point (kill -9 included) loses only the requests in flight, and the same
command resumes where it stopped. Owns the journal file: its header, its lines, when they reach the disk, and
its removal.

Layout: JSONL. The first line is the header (`{"cbq_run_journal": 1, "input_sha256": ..., "settings": {...}}`);
every other line is one `ResultLine`. A line torn by a kill is dropped (and cut off) when the journal is read.
Lines are written through as they come (a killed process loses nothing the OS has) and fsynced at most every
`FSYNC_INTERVAL_SECONDS` (an OS crash loses at most that much).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from pydantic import ValidationError

from schemas.result import ResultLine

FORMAT_VERSION = 1
JOURNAL_SUFFIX = ".cbq-journal"
FSYNC_INTERVAL_SECONDS = 1.0
LOAD_SLICE = 2000  # results handed over per call when a journal is replayed


class JournalMismatch(RuntimeError):
    """The journal beside the output belongs to another input or other settings; the message says which and
    how to start over."""


def journal_path(output: str) -> str:
    return output + JOURNAL_SUFFIX


def input_sha256(lines: Iterable[bytes]) -> str:
    """The content hash of an input, over its lines as `reopenable_lines` yields them."""
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line)
        digest.update(b"\n")
    return digest.hexdigest()


class Journal:
    """An open journal: `replay` what an earlier run left in it, then `append` (the worker's
    `on_results_written`), and `close` or `remove` it."""

    def __init__(self, path: str, file: IO[bytes], is_resumed: bool):
        self.path = path
        self._file = file
        self.is_resumed = is_resumed  # it holds an earlier run's results, not yet replayed
        self.num_finished = 0  # results in the journal, replayed ones included
        self._last_fsync = time.monotonic()

    @classmethod
    def open(cls, path: str, input_hash: str, settings: dict[str, Any], fresh: bool) -> Journal:
        """The journal at `path` for a run of `input_hash` with `settings` (JSON values). A new one is started
        when there is none or `fresh` is set. Raises `JournalMismatch` if the journal there was written for
        another input or other settings."""
        header = {"cbq_run_journal": FORMAT_VERSION, "input_sha256": input_hash, "settings": settings}
        if fresh or not os.path.exists(path):
            return cls._start(path, header)
        file = open(path, "r+b")  # noqa: SIM115 (kept open: the journal is appended to until the run ends)
        try:
            _check_header(path, file.readline(), header)
        except BaseException:
            file.close()
            raise
        return cls(path, file, is_resumed=True)

    def replay(self, into: Callable[[list[ResultLine]], None]) -> int:
        """Hand the results an earlier run left here to `into`, in slices of `LOAD_SLICE`; returns how many.
        A line torn by a kill is cut off, so appends start on a clean line."""
        if not self.is_resumed:
            return 0
        self.is_resumed = False
        num_results, good_end = _replay(self._file, into)
        self._file.truncate(good_end)
        self._file.seek(good_end)
        self.num_finished += num_results
        return num_results

    @classmethod
    def _start(cls, path: str, header: dict[str, Any]) -> Journal:
        """A new journal holding only its header, put in place atomically (a kill leaves the old one or this)."""
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return cls(path, open(path, "ab"), is_resumed=False)  # noqa: SIM115

    def append(self, results: list[ResultLine]) -> None:
        self._file.write(b"".join(r.model_dump_json(exclude_none=True).encode() + b"\n" for r in results))
        self._file.flush()
        self.num_finished += len(results)
        if time.monotonic() - self._last_fsync >= FSYNC_INTERVAL_SECONDS:
            os.fsync(self._file.fileno())
            self._last_fsync = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def remove(self) -> None:
        self.close()
        os.unlink(self.path)


def _check_header(path: str, raw: bytes, expected: dict[str, Any]) -> None:
    try:
        header = json.loads(raw)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("cbq_run_journal") != FORMAT_VERSION:
        raise JournalMismatch(
            f"{path} is not a cbq run journal this version reads; pass --fresh to start over"
        )
    if header.get("input_sha256") != expected["input_sha256"]:
        raise JournalMismatch(
            f"the input changed since the interrupted run whose results are in {path}; pass --fresh to start "
            "over (its results are discarded), or run the original input"
        )
    theirs, ours = header.get("settings", {}), expected["settings"]
    changed = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    if changed:
        was = ", ".join(f"{k}={theirs.get(k)!r}" for k in changed)
        raise JournalMismatch(
            f"{path} was written by a run with {was}; run it with the same settings to resume, or pass --fresh "
            "to start over"
        )


def _replay(file: IO[bytes], replay: Callable[[list[ResultLine]], None]) -> tuple[int, int]:
    """Hand the journal's results to `replay` in slices; returns (how many, the offset after the last whole
    line). Cancelled requests are left out (they run again), and so is a second line for the same request."""
    num_results = 0
    seen: set[int] = set()
    good_end = file.tell()
    piece: list[ResultLine] = []
    for line, end in _whole_lines(file):
        try:
            result = ResultLine.model_validate_json(line)
        except ValidationError:
            break  # torn or garbled: everything from here on is redone
        good_end = end
        if result.finish_reason == "cancelled" or result.index in seen:
            continue
        seen.add(result.index)
        piece.append(result)
        if len(piece) == LOAD_SLICE:
            replay(piece)
            num_results += len(piece)
            piece = []
    if piece:
        replay(piece)
        num_results += len(piece)
    return num_results, good_end


def _whole_lines(file: IO[bytes]) -> Iterator[tuple[bytes, int]]:
    """(line, offset after it) for each line that ends with a newline."""
    while True:
        line = file.readline()
        if not line.endswith(b"\n"):
            return
        yield line, file.tell()
