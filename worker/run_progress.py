"""`cbq run`'s progress report on stderr: requests done of the total, output tok/s and ETA. On a terminal one
line redrawn in place (at most `REDRAW_SECONDS` apart); otherwise (a log file, CI) a plain line every
`interval_seconds`. Owns those counters and that output, nothing else.

The ETA waits for a rate worth extrapolating: it is measured from the first result on (loading, the first
prefills and the engine's warm-up are not a rate), and shown once `ETA_WARMUP_SECONDS` have passed since then.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from schemas.result import ResultLine

REDRAW_SECONDS = 0.2
DEFAULT_PLAIN_INTERVAL_SECONDS = 30.0
ETA_WARMUP_SECONDS = 3.0


class RunProgress:
    def __init__(
        self,
        num_total: int,
        num_done: int = 0,
        stream: TextIO | None = None,
        is_tty: bool | None = None,
        interval_seconds: float = DEFAULT_PLAIN_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = self.stream.isatty() if is_tty is None else is_tty
        self.interval_seconds = REDRAW_SECONDS if self.is_tty else interval_seconds
        self.num_total = num_total
        self.num_resumed = num_done  # done by an earlier, interrupted run
        self.num_done = num_done
        self.num_output_tokens = 0  # this run's only: its rate is what the ETA uses
        self._clock = clock
        self._started = clock()
        self._last_shown = self._started
        self._first_result: tuple[float, int] | None = None  # (when, num_done then): where the ETA's rate starts
        self._drawn = False

    @property
    def num_done_here(self) -> int:
        """Results of this run (the earlier run's, replayed from the journal, not counted)."""
        return self.num_done - self.num_resumed

    def elapsed_seconds(self) -> float:
        return self._clock() - self._started

    def update(self, results: list[ResultLine]) -> None:
        """Count results written (the worker's `on_results_written`); show the line when it is due."""
        now = self._clock()
        self.num_done += len(results)
        self.num_output_tokens += sum(r.usage.completion_tokens for r in results)
        if self._first_result is None and results:
            self._first_result = (now, self.num_done)
        if now - self._last_shown >= self.interval_seconds:
            self._last_shown = now
            self._show(self.line(now))

    def line(self, now: float | None = None) -> str:
        now = self._clock() if now is None else now
        seconds = max(now - self._started, 1e-9)
        left = self.num_total - self.num_done
        resumed = f" ({self.num_resumed} from the earlier run)" if self.num_resumed else ""
        eta = "0 s" if left == 0 else "-"
        if left and self._first_result is not None and now - self._first_result[0] >= ETA_WARMUP_SECONDS:
            since, done_then = self._first_result
            done_since = self.num_done - done_then
            eta = _duration(left * (now - since) / done_since) if done_since else "-"
        return (
            f"{self.num_done}/{self.num_total} requests{resumed}  {self.num_output_tokens / seconds:,.0f} "
            f"output tok/s  ETA {eta}"
        )

    def finish(self) -> None:
        """The final line (and the end of a redrawn one)."""
        self._show(self.line(self._clock()))
        if self.is_tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()

    def _show(self, text: str) -> None:
        if self.is_tty:
            self.stream.write("\r\x1b[2K" + text)  # back to the start of the line and clear it
            self._drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
