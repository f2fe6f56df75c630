"""`bench engine --trace FILE`: a timeline of each measured run's steps, and a picture of device busy over time.

Owns the spans of a traced run (`StepTracer`, the object `Engine.trace_steps` hands the loop and the runner), the
trace-event JSON written from them (Chrome's format: Perfetto and chrome://tracing open it) and the PNG.

A step has five spans, one track (tid) each: CPU preparation (scheduling and batch building), H2D (the step's
inputs copied up), compute (forward and sampling), D2H (sampled ids copied down) and CPU wait (the host blocked
until they arrived). On CUDA the three device spans come from timing-enabled events recorded on each stage's
stream, placed on the host clock by one calibration (an event recorded and waited for as the run starts: its
device time is taken as that host instant); on CPU every stage runs in turn on the host and is host-timed.
Each run is one process (pid) of the trace, its time counted from its own start, so that runs line up.

The PNG is the device's busy fraction (compute spans) per time bin, one band per run on one time scale (the first
run on top: sync above async for `--mode both`). Drawn with matplotlib where it imports (titled, with axes);
otherwise written directly (zlib + struct, no labels: the bands are the trace's runs in order, bars the busy
fraction of each bin, a band's full height 100%).
"""

from __future__ import annotations

import importlib
import json
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACKS = ("CPU preparation", "H2D", "compute", "D2H", "CPU wait")
PREP, H2D, COMPUTE, D2H, WAIT = range(len(TRACKS))
MAX_STEPS = 1 << 17  # spans kept per run: beyond this a run's trace stops growing (about 13 MB of JSON)


@dataclass(frozen=True)
class Span:
    track: int  # index into TRACKS
    start: float  # seconds since the run began, on the host clock
    end: float
    step: int  # the step's index in the run
    name: str


class StepTracer:
    """Collects one run's spans: `on_prep` from the engine's loop, `on_step` from the runner's `wait` (steps are
    waited for in launch order, so the k-th preparation and the k-th wait are the same step)."""

    def __init__(self, device: Any):
        self.is_cuda = getattr(device, "type", "cpu") == "cuda"
        self._ref: Any = None
        if self.is_cuda:
            import torch

            torch.cuda.synchronize(device)
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()
            self._ref.synchronize()
        self.origin = time.perf_counter()  # the run's zero; on CUDA also the host instant of `_ref`
        self.spans: list[Span] = []
        self.num_prepared = 0
        self.num_steps = 0

    def on_prep(self, start: float, end: float) -> None:
        if self.num_prepared < MAX_STEPS:
            self.spans.append(Span(PREP, start - self.origin, end - self.origin, self.num_prepared, "prepare"))
        self.num_prepared += 1

    def on_step(self, marks: Any, wait_start: float, wait_end: float, meta: Any) -> None:
        """One waited step: its StageMarks (worker/engine/step_trace.py), the host seconds `wait` blocked, its BatchMeta."""
        step = self.num_steps
        self.num_steps += 1
        if step >= MAX_STEPS or marks is None:
            return
        kind = f"decode {meta.num_seqs}" if meta.is_decode_only else f"{meta.num_tokens} tokens, {meta.num_seqs} seqs"
        stages = (
            (H2D, marks.h2d_start, marks.h2d_end),
            (COMPUTE, marks.compute_start, marks.compute_end),
            (D2H, marks.d2h_start, marks.d2h_end),
        )
        for track, start, end in stages:
            self.spans.append(Span(track, self._seconds(start), self._seconds(end), step, kind))
        self.spans.append(Span(WAIT, wait_start - self.origin, wait_end - self.origin, step, "wait"))

    def _seconds(self, mark: Any) -> float:
        """A mark as seconds since the run began: a host time as is, a CUDA event through the calibration."""
        if isinstance(mark, float):
            return mark - self.origin
        # NOTE: elapsed_time raises on an event that has not completed. The runner records each end mark before the
        # stage's done event, so after `wait` all have; the wait here costs nothing then, and guards the order.
        mark.synchronize()
        return self._ref.elapsed_time(mark) / 1000.0

    def track_spans(self, track: int) -> list[Span]:
        return sorted((s for s in self.spans if s.track == track), key=lambda s: s.start)

    def summary(self) -> dict:
        """What the run's JSON result records of its trace: steps, spans, and the device's busy fraction between
        the first span's start and the last one's end."""
        compute = self.track_spans(COMPUTE)
        start = min((s.start for s in self.spans), default=0.0)
        end = max((s.end for s in self.spans), default=0.0)
        busy = sum(s.end - s.start for s in compute)
        return {
            "steps": self.num_steps,
            "spans": len(self.spans),
            "device_busy": busy / (end - start) if end > start else 0.0,
            "clock": "cuda events, calibrated to the host" if self.is_cuda else "host",
        }


def trace_events(runs: list[tuple[str, StepTracer]]) -> dict:
    """The Chrome/Perfetto trace-event document of `runs` (label, tracer): a process per run, a thread per track,
    one complete ("X") event per span, ts and dur in microseconds."""
    events: list[dict] = []
    for pid, (label, tracer) in enumerate(runs, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, track in enumerate(TRACKS, start=1):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for s in tracer.spans:
            events.append({
                "ph": "X", "name": s.name, "cat": TRACKS[s.track], "pid": pid, "tid": s.track + 1,
                "ts": s.start * 1e6, "dur": max(0.0, s.end - s.start) * 1e6, "args": {"step": s.step},
            })  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def busy_fractions(spans: list[Span], num_bins: int, seconds: float) -> list[float]:
    """The fraction of each of `num_bins` equal bins of [0, seconds] that `spans` (one track's, not overlapping)
    cover."""
    width = seconds / num_bins
    covered = [0.0] * num_bins
    for s in spans:
        first, last = int(max(0.0, s.start) / width), min(num_bins - 1, int(s.end / width))
        for b in range(first, last + 1):
            covered[b] += max(0.0, min(s.end, (b + 1) * width) - max(s.start, b * width))
    return [min(1.0, c / width) for c in covered]


def write_trace(path: str | Path, runs: list[tuple[str, StepTracer]]) -> tuple[Path, Path, str]:
    """Write the trace JSON to `path` and the busy picture beside it (`path` with .png); returns both paths and
    which writer drew the picture."""
    path = Path(path)
    path.write_text(json.dumps(trace_events(runs)))
    png = path.with_suffix(".png")
    return path, png, write_busy_png(png, runs)


def write_busy_png(path: Path, runs: list[tuple[str, StepTracer]], num_bins: int = 400) -> str:
    """Device busy per time bin, a band per run on one time scale. Returns which writer drew it."""
    seconds = max((s.end for _, t in runs for s in t.spans), default=0.0) or 1.0
    bands = [(label, busy_fractions(t.track_spans(COMPUTE), num_bins, seconds)) for label, t in runs]
    busy_of_run = [t.summary()["device_busy"] for _, t in runs]
    try:  # by name: matplotlib is no dependency of cbq's
        importlib.import_module("matplotlib").use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        write_png(path, *_draw_bands([busy for _, busy in bands]))
        return "png writer"
    fig, axes = plt.subplots(len(bands), 1, figsize=(10, 1.8 * len(bands)), sharex=True, squeeze=False)
    times = [seconds * (b + 0.5) / num_bins for b in range(num_bins)]
    for ax, (label, busy), run_busy in zip(axes[:, 0], bands, busy_of_run, strict=True):
        ax.fill_between(times, busy, step="mid", alpha=0.8)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("busy")
        ax.set_title(f"{label}: device busy {run_busy:.1%} of its run", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


BAND_HEIGHT, GAP, BIN_WIDTH = 100, 12, 2
COLORS = ((214, 96, 40), (40, 110, 200), (60, 160, 80), (150, 80, 170))  # a band's bars, by run
BACKGROUND, EMPTY = (255, 255, 255), (232, 232, 232)


def _draw_bands(bands: list[list[float]]) -> tuple[int, int, list[bytes]]:
    """RGB rows of the busy picture: a grey band per run, a bar per bin rising to its busy fraction."""
    width = max((len(b) for b in bands), default=1) * BIN_WIDTH
    rows: list[bytes] = []
    for r, busy in enumerate(bands):
        color = COLORS[r % len(COLORS)]
        rows += [bytes(BACKGROUND) * width] * GAP
        for y in range(BAND_HEIGHT):
            level = (BAND_HEIGHT - y) / BAND_HEIGHT  # this row's height in the band, 1.0 at the top
            row = bytearray(bytes(EMPTY) * width)
            for b, fraction in enumerate(busy):
                if fraction >= level - 0.5 / BAND_HEIGHT:
                    row[3 * b * BIN_WIDTH : 3 * (b + 1) * BIN_WIDTH] = bytes(color) * BIN_WIDTH
            rows.append(bytes(row))
    rows += [bytes(BACKGROUND) * width] * GAP
    return width, len(rows), rows


def write_png(path: Path, width: int, height: int, rows: list[bytes]) -> None:
    """An 8-bit RGB PNG of `rows` (each 3 * width bytes)."""
    assert len(rows) == height and all(len(r) == 3 * width for r in rows), "one RGB row per line"

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # bit depth 8, colour type 2 (RGB)
    pixels = zlib.compress(b"".join(b"\x00" + r for r in rows), 9)  # filter 0 on every row
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))
