"""Helpers shared by every `cbq` command, producer or worker side: input lines, status text, result files.

Owns how the CLI reads JSONL input, shows a `BatchStatus` and writes result lines. Commands import this
module, never each other.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator

import click

from schemas.json_line import jsonl_safe
from schemas.result import OpenAIBatchOutputLine, ResultLine
from schemas.status import BatchStatus


@contextlib.contextmanager
def reopenable_lines(file) -> Iterator[tuple[Callable[[], Iterator[bytes]], int]]:
    """(reopen, size in bytes) for a binary file: each `reopen()` reads its lines from the start, split on
    b"\\n" only (str.splitlines() would also split inside JSON strings at U+2028 etc.). Lines stay bytes: each
    is decoded when it is validated, so a bad UTF-8 byte fails its own line. Validation reads the file once
    and submission again, so no command holds a whole batch file in memory; stdin or a pipe is first copied
    to a temporary file on disk."""
    with contextlib.ExitStack() as stack:
        if not file.seekable():
            spool = stack.enter_context(tempfile.TemporaryFile())
            shutil.copyfileobj(file, spool, 1 << 20)
            file = spool

        def reopen() -> Iterator[bytes]:
            file.seek(0)
            for line in file:
                yield line.rstrip(b"\n")

        yield reopen, file.seek(0, os.SEEK_END)


def check_output_path(path: str, param_hint: str, input_path: str | None = None) -> None:
    """A one-line click error, before any work, for an output path that cannot be written: its folder is
    missing or not writable, or it is the input file itself (through a symlink or another spelling too)."""
    if path == "-":
        return
    if input_path not in (None, "-", "<stdin>") and _is_same_file(path, input_path):
        raise click.ClickException(f"{param_hint} {path} is the input file: give another path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise click.ClickException(f"{param_hint} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise click.ClickException(f"{param_hint} {path}: the folder {folder} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise click.ClickException(f"{param_hint} {path} is not writable")


def _is_same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links too
    except OSError:  # one of them does not exist yet
        return False


def warn_overridden_defaults(validated, defaults) -> None:
    """One stderr line per sampling flag that some lines override with their own value (values on a line win,
    as in vLLM, where the flags are defaults too). `validated`: a `ValidatedFile`; `defaults`: the flags'
    `Sampling`. Reads the requests once more, only when a flag was given."""
    given = defaults.given()
    if not given:
        return
    overridden = dict.fromkeys(given, 0)
    for request in validated.requests:
        overrides = getattr(request, "overrides", None)  # None: a request that fails alone
        for name, value in given.items():
            if overrides is not None and getattr(overrides, name) not in (None, value):
                overridden[name] += 1
    for name, count in overridden.items():
        if count:
            spelled = f"{name} (or max_tokens)" if name == "max_new_tokens" else name
            click.echo(
                f"note: --{name.replace('_', '-')} {given[name]} is a default: {count} line(s) give their own "
                f"{spelled}, which wins",
                err=True,
            )


def format_status(st: BatchStatus, device: str = "device", wall_seconds: float | None = None) -> str:
    """`st` as text. `device`: what ran it, when known ("CPU", "GPU"); its seconds are the engine's step time.
    `wall_seconds`: the wall time to show (default: from submission to the last result, or to now)."""
    name = f" ({st.name})" if st.name else ""
    eta = "-" if st.eta_seconds is None else f"{st.eta_seconds:.0f} s"
    if wall_seconds is None:
        end = st.last_finished_at if st.is_done and st.last_finished_at else time.time()
        wall_seconds = max(end - st.created_at, 0.0) if st.created_at else 0.0
    if st.num_stalled:
        eta += f" ({st.num_stalled} requests wait for a dead worker's chunks to be re-enqueued)"
    model = ""
    if st.model and st.num_model_workers == 0:
        model = f"\n  no live worker serves model {st.model!r}: start one with --served-model-name {st.model}"
    return "\n".join(
        [
            f"batch {st.batch_id}{name} on queue {st.queue}: {st.state}{model}",
            f"  total {st.num_total}  queued {st.num_queued}  running {st.num_running}  "
            f"completed {st.num_completed}  failed {st.num_failed}  cancelled {st.num_cancelled}",
            f"  tokens: prompt {st.prompt_tokens}  completion {st.completion_tokens}  {device} {st.gpu_seconds:.2f} s",
            f"  rate {st.requests_per_second:.1f} req/s  {st.completion_tokens_per_second:.1f} completion tok/s  "
            f"ETA {eta}  wall {wall_seconds:.1f} s",
            *(f"  inconsistent: {issue}" for issue in st.inconsistencies),
        ]
    )


def status_json(st: BatchStatus) -> dict:
    return {**st.model_dump(), "state": st.state, "is_done": st.is_done}


def write_result_lines(
    output: str, lines: Iterator[ResultLine | OpenAIBatchOutputLine], output_format: str, errors: str | None = None
) -> tuple[int, int]:
    """Write result lines (from `store.iter_results`) as JSONL to `output` (`-`: stdout). With `errors`, failed
    and cancelled requests (`is_failure`) go to that file instead, as OpenAI's batch error file. Returns how
    many lines went to `output` and to `errors`.

    Files are written atomically. The first line is read before a file is opened, so an error raised by
    `lines` (batch not found, not finished) leaves no file behind. cbq lines leave out empty fields; OpenAI
    lines keep their nulls, as OpenAI writes them.
    """
    first = next(lines, None)
    counts = {False: 0, True: 0}
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(click.open_file(output, "w", encoding="utf-8", atomic=output != "-"))
        error_out = out
        if errors is not None:
            error_out = stack.enter_context(click.open_file(errors, "w", encoding="utf-8", atomic=errors != "-"))
        for line in itertools.chain([first] if first is not None else [], lines):
            to_errors = errors is not None and line.is_failure
            (error_out if to_errors else out).write(jsonl_safe(line.model_dump_json(exclude_none=output_format == "cbq")) + "\n")
            counts[to_errors] += 1
    return counts[False], counts[True]
