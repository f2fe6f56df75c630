"""The server's batch lifecycle: validate and submit an input file, watch the batch, write its output files.

Owns the transitions of `batch_object.py`'s status diagram; the records themselves live in `producer.store`.
Everything else goes through `producer.client`, like the CLI. Every call names the `Principal` it acts for: a
batch of another project is not found.
Slow work (validating a 200 MB file, writing output files) runs on small thread pools, never in a request:
- `create` records the batch as validating and queues `_validate_and_submit`, which streams the input file from
  disk line by line, and either submits it (in_progress) or records OpenAI-shaped errors (failed). Whatever goes
  wrong there (a file that is not UTF-8, a bug) ends the batch `failed`, never stuck in `validating`. Validations
  run `max_validations` at a time (one by default; the others wait, `validating`), and each keeps only the first
  errors it finds (`MAX_REPORTED_ERRORS`, what the record keeps) and counts the rest, so a file of a million bad
  lines costs the server no more memory than one of a thousand. A file of more than `max_lines_per_file` lines
  fails at that line, so what a validation holds (the custom_ids) stays bounded too.
- `view` reads the cbq status; once every request has finished it queues `_finalize` (at most one per batch
  across server processes, through a Redis lock), which streams the results into an output file and an error
  file; when the window has run out it cancels what is left first.
"""

from __future__ import annotations

import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor

from producer.client import BatchNotFound, Client
from producer.server.auth import Principal
from producer.server.batch_object import batch_object
from producer.server.files import FileStore
from producer.store.api_batches import MAX_REPORTED_ERRORS, BatchRecord, BatchRecordNotFound, BatchRecords
from schemas.embeddings import EMBEDDINGS_URL
from schemas.errors import RequestLineError
from schemas.json_line import jsonl_safe
from schemas.request import CHAT_COMPLETIONS_URL, COMPLETIONS_URL
from schemas.responses_body import RESPONSES_URL
from schemas.result import OpenAIBatchOutputLine
from schemas.status import BatchStatus

log = logging.getLogger("cbq.server")

SUPPORTED_ENDPOINTS = (CHAT_COMPLETIONS_URL, COMPLETIONS_URL, RESPONSES_URL, EMBEDDINGS_URL)
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
# Lines of one input file: what the server holds of a file while validating and submitting it grows with its
# requests (their custom_ids, about 200 bytes each): 500,000 took a server from 53 to 151 MB peak RSS.
DEFAULT_MAX_LINES_PER_FILE = 500_000
# A batch still validating this long after it was created lost its validation (the server restarted, or Redis was
# unreachable when it ended); validating a 200 MB file takes about a minute.
VALIDATION_STALE_SECONDS = 3600
_WINDOW_RE = re.compile(r"^([1-9][0-9]{0,6})(s|m|h|d)$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_completion_window(window: str) -> int | None:
    """Seconds of a window such as "24h" (OpenAI's only value) or "30m"; None if malformed."""
    match = _WINDOW_RE.match(window)
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)] if match else None


class BatchService:
    def __init__(
        self,
        client: Client,
        files: FileStore,
        ttl_seconds: int,
        chunk_size: int,
        max_threads: int = 2,
        max_validations: int = 1,
        max_lines_per_file: int = DEFAULT_MAX_LINES_PER_FILE,
        validation_stale_seconds: int = VALIDATION_STALE_SECONDS,
    ):
        self.client = client
        self.files = files
        self.records = BatchRecords(client.connection, ttl_seconds)
        self.ttl_seconds = ttl_seconds
        self.chunk_size = chunk_size
        self.validation_stale_seconds = validation_stale_seconds
        self.max_lines_per_file = max_lines_per_file
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="cbq-server")
        self._validations = ThreadPoolExecutor(max_workers=max_validations, thread_name_prefix="cbq-validate")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._validations.shutdown(wait=False, cancel_futures=True)

    # --- create ------------------------------------------------------------------------------------------------

    def create(self, principal: Principal, **fields) -> dict:
        record = self.records.create(principal.project, **fields)
        self._validations.submit(self._validate_or_fail, record.id)
        return batch_object(record, None)

    def _validate_or_fail(self, api_batch_id: str) -> None:
        try:
            self._validate_and_submit(api_batch_id)
        except Exception as exc:
            log.exception("validating batch %s failed", api_batch_id)
            message = f"the server could not validate the input file: {type(exc).__name__}"
            try:
                self.records.update(
                    api_batch_id,
                    only_if_unset=True,
                    errors=[_entry("validation_failed", message, None, None)],
                    failed_at=int(time.time()),
                )
            except Exception:
                log.exception("recording the failure of batch %s failed", api_batch_id)

    def _validate_and_submit(self, api_batch_id: str) -> None:
        record = self.records.get(api_batch_id)
        if self.files.leading_bytes(record.input_file_id, 2) in UTF16_BOMS:
            message = (
                "the file is UTF-16 (it starts with a UTF-16 byte order mark); batch files must be UTF-8"
            )
            errors = [_entry("invalid_encoding", message, None, 1)]
            self.records.update(api_batch_id, errors=errors, failed_at=int(time.time()))
            return
        try:
            validated = self.client.validate(
                lambda: self._bounded_lines(record.input_file_id),
                endpoint=record.endpoint,
                max_errors=MAX_REPORTED_ERRORS - 1,  # and one entry that counts the others
            )
        except _TooManyLines:
            message = (
                f"the file has more than {self.max_lines_per_file} lines, this server's limit "
                "(--max-lines-per-file); split it into several batches"
            )
            errors = [_entry("too_many_lines", message, None, self.max_lines_per_file + 1)]
            self.records.update(api_batch_id, errors=errors, failed_at=int(time.time()))
            return
        errors = [_error_entry(e) for e in validated.errors]  # format errors; invalid requests fail alone
        if not errors and not validated.requests:
            errors.append(_entry("empty_file", "the input file has no requests", None, None))
        now = int(time.time())
        if errors:
            errors.sort(key=lambda e: e["line"] or 0)
            if validated.num_errors_dropped:
                message = (
                    f"{validated.num_errors_dropped} more errors are not listed "
                    f"({validated.num_errors} lines in all have errors)"
                )
                errors.append(_entry("too_many_errors", message, None, None))
            self.records.update(api_batch_id, errors=errors[:MAX_REPORTED_ERRORS], failed_at=now)
            return
        current = self.records.get(api_batch_id)
        if current.failed_at:  # given up on as stale meanwhile (`_view`)
            return
        if current.cancelling_at:  # cancelled while validating: submit nothing
            self.records.update(api_batch_id, cancelled_at=now)
            return
        batch = self.client.submit(validated, chunk_size=self.chunk_size, ttl_seconds=self.ttl_seconds)
        self.records.update(api_batch_id, cbq_batch_id=batch.id, in_progress_at=now)
        if self.records.get(api_batch_id).cancelling_at:  # cancelled while it was being submitted
            batch.cancel()

    def _bounded_lines(self, file_id: str):
        for line_no, line in enumerate(self.files.iter_lines(file_id), start=1):
            if line_no > self.max_lines_per_file:  # before anything of the line is kept
                raise _TooManyLines
            yield line

    # --- read --------------------------------------------------------------------------------------------------

    def view(self, principal: Principal, api_batch_id: str) -> dict:
        """The batch object; moves the batch on when its requests are done or its window has run out."""
        return self._view(self._visible(principal, api_batch_id))

    def _visible(self, principal: Principal, api_batch_id: str) -> BatchRecord:
        record = self.records.get(api_batch_id)
        if not principal.can_see(record.project):
            raise BatchRecordNotFound(api_batch_id)
        return record

    def _view(self, record: BatchRecord) -> dict:
        api_batch_id = record.id
        if self._is_stale_validation(record):
            now = int(time.time())
            if record.cancelling_at:
                self.records.update(api_batch_id, only_if_unset=True, cancelled_at=now)
            else:
                message = "the input file's validation did not finish (the server restarted or lost Redis)"
                errors = [_entry("validation_interrupted", message, None, None)]
                self.records.update(api_batch_id, only_if_unset=True, errors=errors, failed_at=now)
            record = self.records.get(api_batch_id)
        status = self._cbq_status(record)
        if status is not None and not record.is_terminal:
            if not status.is_done and time.time() >= record.expires_at and not record.expire_requested_at:
                self.records.update(api_batch_id, only_if_unset=True, expire_requested_at=int(time.time()))
                self.client.batch(status.batch_id).cancel()
            elif status.is_done and self.records.take_finalize_lock(api_batch_id):
                self.records.update(api_batch_id, only_if_unset=True, finalizing_at=int(time.time()))
                self._pool.submit(self._logged, self._finalize, api_batch_id)
            record = self.records.get(api_batch_id)
        return batch_object(record, status)

    def _is_stale_validation(self, record: BatchRecord) -> bool:
        return (
            record.cbq_batch_id is None
            and not record.is_terminal
            and time.time() - record.created_at > self.validation_stale_seconds
        )

    def list(self, principal: Principal, after: str | None, limit: int) -> tuple[list[dict], bool]:
        listing = principal.listing_project
        ids, has_more = self.records.list_ids(listing, after, limit)
        out = []
        for api_batch_id in ids:
            try:
                out.append(self.view(principal, api_batch_id))
            except LookupError:
                self.records.forget(api_batch_id, listing)
        return out, has_more

    def _cbq_status(self, record: BatchRecord) -> BatchStatus | None:
        if record.cbq_batch_id is None:
            return None
        try:
            return self.client.batch(record.cbq_batch_id).status()
        except BatchNotFound:  # its results expired before the record did
            return None

    # --- cancel ------------------------------------------------------------------------------------------------

    def cancel(self, principal: Principal, api_batch_id: str) -> dict:
        record = self._visible(principal, api_batch_id)
        if not record.is_terminal and not record.finalizing_at:  # finalizing: every request has finished
            self.records.update(api_batch_id, only_if_unset=True, cancelling_at=int(time.time()))
            if record.cbq_batch_id is not None:
                self.client.batch(record.cbq_batch_id).cancel()
        return self._view(self.records.get(api_batch_id))

    # --- finalize ----------------------------------------------------------------------------------------------

    def _finalize(self, api_batch_id: str) -> None:
        """Write the output file (successful requests) and the error file (the others), then the final status."""
        record = self.records.get(api_batch_id)
        assert record.cbq_batch_id is not None, f"{api_batch_id} is finalized before it was submitted"
        ttl = record.output_expires_seconds
        with (
            self.files.writer(f"{api_batch_id}_output.jsonl", "batch_output", record.project, ttl) as output,
            self.files.writer(f"{api_batch_id}_error.jsonl", "batch_output", record.project, ttl) as errors,
        ):
            num_output = num_errors = 0
            for line in self.client.batch(record.cbq_batch_id).results(format="openai"):
                assert isinstance(line, OpenAIBatchOutputLine), type(line)
                failed = line.is_failure
                (errors if failed else output).write(jsonl_safe(line.model_dump_json()).encode() + b"\n")
                num_output += not failed
                num_errors += failed
        now = int(time.time())
        outcome = "completed_at"
        if record.cancelling_at:
            outcome = "cancelled_at"
        elif record.expire_requested_at:
            outcome = "expired_at"
        changes: dict = {outcome: now}
        for writer, num_lines, field in (
            (output, num_output, "output_file_id"),
            (errors, num_errors, "error_file_id"),
        ):
            assert writer.record is not None, "a writer that exited cleanly has stored its file"
            if num_lines:
                changes[field] = writer.record.id
            else:
                self.files.delete(writer.record.id)
        self.records.update(api_batch_id, **changes)

    @staticmethod
    def _logged(fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("%s%s failed", fn.__name__, args)


class _TooManyLines(Exception):
    pass


def _error_entry(error: RequestLineError) -> dict:
    issue = error.issues[0]
    if issue.code == "mismatched_endpoint":
        code = issue.code
    elif issue.message.startswith("invalid UTF-8"):
        code = "invalid_encoding"
    elif issue.message.startswith("invalid JSON"):
        code = "invalid_json_line"
    elif issue.message.startswith("duplicate custom_id"):
        code = "duplicate_custom_id"
    else:
        code = "invalid_request"
    message = "; ".join(str(i) for i in error.issues)
    return _entry(code, message, issue.field or None, error.line_no)


def _entry(code: str, message: str, param: str | None, line: int | None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}
