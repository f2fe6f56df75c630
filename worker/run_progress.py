"""`cbq run`'s progress report on stderr: requests done of the total, output tok/s and ETA. On a terminal one
line redrawn in place (at most `REDRAW_SECONDS` apart); otherwise (a log file, CI) a plain line every
`interval_seconds`. Owns those counters and that output, nothing else.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from schemas.result import ResultLine

REDRAW_SECONDS = 0.2
DEFAULT_PLAIN_INTERVAL_SECONDS = 30.0


class RunProgress:
    def __init__(
        self,
        num_total: int,
        num_done: int = 0,
        stream: TextIO | None = None,
        is_tty: bool | None = None,
        interval_seconds: float = DEFAULT_PLAIN_INTERVAL_SECONDS,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = self.stream.isatty() if is_tty is None else is_tty
        self.interval_seconds = REDRAW_SECONDS if self.is_tty else interval_seconds
        self.num_total = num_total
        self.num_resumed = num_done  # done by an earlier, interrupted run
        self.num_done = num_done
        self.num_output_tokens = 0  # this run's only: its rate is what the ETA uses
        self._started = time.monotonic()
        self._last_shown = self._started
        self._drawn = False

    def update(self, results: list[ResultLine]) -> None:
        """Count results written (the worker's `on_results_written`); show the line when it is due."""
        self.num_done += len(results)
        self.num_output_tokens += sum(r.usage.completion_tokens for r in results)
        now = time.monotonic()
        if now - self._last_shown >= self.interval_seconds:
            self._last_shown = now
            self._show(self.line(now))

    def line(self, now: float | None = None) -> str:
        seconds = max((now or time.monotonic()) - self._started, 1e-9)
        done_here = self.num_done - self.num_resumed
        left = self.num_total - self.num_done
        eta = _duration(left * seconds / done_here) if done_here else "-"
        resumed = f" ({self.num_resumed} from the earlier run)" if self.num_resumed else ""
        return (
            f"{self.num_done}/{self.num_total} requests{resumed}  {self.num_output_tokens / seconds:,.0f} "
            f"output tok/s  ETA {eta}"
        )

    def finish(self) -> None:
        """The final line (and the end of a redrawn one)."""
        self._show(self.line())
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
