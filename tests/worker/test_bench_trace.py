"""`bench engine --trace` on CPU with a tiny model: the trace-event JSON (a process per run, a thread per track,
spans in order and not overlapping on each track), the busy picture's PNG, and tracing off by default."""

from __future__ import annotations

import importlib.util
import itertools
import json
import struct
import sys
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from worker.bench import engine as bench_engine
from worker.bench import trace


def check_trace(document: dict, labels: list[str]) -> dict[int, dict[int, list[dict]]]:
    """Every run a process with every track; complete events in microseconds, ordered and disjoint per track.
    Returns the events by pid and tid."""
    events = document["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == sorted(labels)
    spans: dict[int, dict[int, list[dict]]] = {pid: {} for pid in names}
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0, e
            spans[e["pid"]].setdefault(e["tid"], []).append(e)
    for pid in names:
        threads = {
            e["tid"]: e["args"]["name"] for e in events if e["pid"] == pid and e["ph"] == "M" and e["name"] == "thread_name"
        }
        assert sorted(threads.values()) == sorted(trace.TRACKS)
        assert set(spans[pid]) == set(threads), "every track has spans"
        for tid, track in spans[pid].items():
            assert [e["ts"] for e in track] == sorted(e["ts"] for e in track), threads[tid]  # in step order
            for a, b in itertools.pairwise(track):
                assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (threads[tid], a, b)  # one at a time on each track
                assert b["args"]["step"] == a["args"]["step"] + 1
    return spans


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_bench_engine_traces_sync_and_async_steps_and_draws_device_busy(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the PNG writer of its own (an import that fails)
    out, trace_file = tmp_path / "run.json", tmp_path / "w1_trace.json"
    args = ["--model", "tiny-llama", "--workload", "tiny", "--num-requests", "2", "--device", "cpu", "--dtype", "float32"]
    args += ["--mode", "both", "--trace", str(trace_file), "--json-out", str(out)]
    result = CliRunner().invoke(bench_engine.engine_bench, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "(png writer)" in result.output
    report = json.loads(out.read_text())
    spans = check_trace(json.loads(trace_file.read_text()), ["sync", "async"])
    for pid, mode in enumerate(("sync", "async"), start=1):
        run = report["results"][mode]
        assert run["extra"]["trace"]["steps"] == run["steps"] > 0
        assert run["extra"]["trace"]["clock"] == "host" and 0 < run["extra"]["trace"]["device_busy"] <= 1
        assert all(len(track) == run["steps"] for track in spans[pid].values())  # five spans a step
        # on CPU the runner times a step's stages on the host, one after the other: together they are its device time
        stages = [e for tid in (trace.H2D, trace.COMPUTE, trace.D2H) for e in spans[pid][tid + 1]]
        assert sum(e["dur"] for e in stages) / 1e6 == pytest.approx(run["gpu_ms"] * run["steps"] / 1000, rel=0.1)
    assert report["trace"] == str(trace_file)
    (tmp_path / "w1_trace_results.json").write_text(out.read_text())  # run_gpu.sh trace's name for it
    entry = _collect_results().main([tmp_path])["W1_trace"]
    assert (entry["trace"], entry["png"]) == ("w1_trace.json", "w1_trace.png")
    assert entry["async"]["trace_device_busy"] == report["results"]["async"]["extra"]["trace"]["device_busy"]
    png = (tmp_path / "w1_trace.png").read_bytes()
    assert png_size(png) == (400 * trace.BIN_WIDTH, 2 * trace.BAND_HEIGHT + 3 * trace.GAP)


def _collect_results():
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("collect_results", root / "benchmarks" / "collect_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_busy_fractions_are_the_covered_share_of_each_bin():
    spans = [trace.Span(trace.COMPUTE, 0.0, 0.5, 0, "a"), trace.Span(trace.COMPUTE, 1.25, 2.0, 1, "b")]
    assert trace.busy_fractions(spans, 4, 2.0) == pytest.approx([1.0, 0.0, 0.5, 1.0])


def test_the_png_writer_writes_the_pixels_it_is_given(tmp_path):
    rows = [bytes([255, 0, 0]) * 3, bytes([0, 0, 255]) * 3]
    trace.write_png(tmp_path / "x.png", 3, 2, rows)
    data = (tmp_path / "x.png").read_bytes()
    assert png_size(data) == (3, 2)
    idat_len = struct.unpack(">I", data[33:37])[0]
    assert data[37:41] == b"IDAT" and data.endswith(b"IEND\xaeB`\x82")
    assert zlib.decompress(data[41 : 41 + idat_len]) == b"".join(b"\x00" + r for r in rows)


def test_no_marks_are_made_unless_a_tracer_is_set():
    from worker.engine.api import EngineRequest, SamplingParams
    from worker.engine.engine import Engine

    engine = Engine.from_model("tiny-llama", device="cpu", dtype="float32")
    seen: list = []

    class Recorder:
        def on_prep(self, start, end):
            seen.append(("prep", end >= start))

        def on_step(self, marks, wait_start, wait_end, meta):
            seen.append(("step", marks is not None and marks.h2d_start <= marks.compute_start <= marks.d2h_end))

    launched = []
    real_launch = engine.runner.launch
    engine.runner.launch = lambda step: launched.append(real_launch(step)) or launched[-1]
    reqs = [EngineRequest(f"r{i}", [1, 2, 3 + i], SamplingParams(max_new_tokens=3, ignore_eos=True)) for i in range(2)]
    engine.generate(reqs)
    assert launched and all(h.marks is None for h in launched) and not seen
    engine.trace_steps(Recorder())
    engine.generate([EngineRequest(f"t{r.request_id}", r.prompt_ids, r.sampling) for r in reqs])
    engine.trace_steps(None)
    assert seen and all(ok for _, ok in seen) and {kind for kind, _ in seen} == {"prep", "step"}
    assert engine.runner.tracer is None


def test_matplotlib_draws_the_busy_picture_where_it_imports(tmp_path):
    pytest.importorskip("matplotlib")
    tracer = trace.StepTracer(None)
    tracer.spans = [trace.Span(trace.COMPUTE, 0.01 * i, 0.01 * i + 0.007, i, "step") for i in range(50)]
    assert trace.write_busy_png(tmp_path / "busy.png", [("sync", tracer), ("async", tracer)]) == "matplotlib"
    width, height = png_size((tmp_path / "busy.png").read_bytes())
    assert width > 100 and height > 100


def test_cuda_marks_are_placed_by_their_time_after_the_calibration_event():
    """On CUDA a mark is an event: its time is the calibration event's host instant plus the device time between
    them, read once the event has completed (an end mark may complete just after the step's d2h_done)."""
    from types import SimpleNamespace

    class Event:
        def __init__(self, ms: float):
            self.ms, self.synchronized = ms, False

        def synchronize(self):
            self.synchronized = True

    class Ref:
        def elapsed_time(self, event):
            assert event.synchronized, "read before it completed"
            return event.ms

    tracer = trace.StepTracer(None)
    tracer._ref = Ref()
    marks = SimpleNamespace(**{f"{stage}_{end}": Event(ms) for (stage, end), ms in zip(
        [(s, e) for s in ("h2d", "compute", "d2h") for e in ("start", "end")], (1.0, 1.5, 2.0, 9.0, 9.5, 9.75), strict=True
    )})  # fmt: skip
    wait_start = tracer.origin + 0.002
    tracer.on_step(marks, wait_start, wait_start + 0.008, SimpleNamespace(is_decode_only=True, num_seqs=4, num_tokens=4))
    got = {trace.TRACKS[s.track]: (s.start, s.end, s.name) for s in tracer.spans}
    assert got["H2D"][:2] == pytest.approx((0.001, 0.0015)) and got["compute"][:2] == pytest.approx((0.002, 0.009))
    assert got["D2H"][:2] == pytest.approx((0.0095, 0.00975)) and got["CPU wait"][:2] == pytest.approx((0.002, 0.010))
    assert got["compute"][2] == "decode 4" and tracer.num_steps == 1
