"""Files of the OpenAI-compatible server, on the server's local disk. Owns the files directory.

Each file is two entries in `root`: `{id}` (the bytes) and `{id}.json` (its `FileRecord`). The data is written
under a temporary name in 1 MiB pieces and renamed into place, then the record is written the same way, so a
file is visible only once complete, and no upload is ever held in memory. Every file expires `ttl_seconds`
after it was created (batch outputs may ask for another expiry); expired files are deleted by
`remove_expired`, which the server runs on uploads, listings and once a minute. A record names the project that
owns the file (`producer.server.auth`); the routes show a file only to its project and to admin keys.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

COPY_PIECE_BYTES = 1 << 20
UTF8_BOM = b"\xef\xbb\xbf"
FILE_ID_RE = re.compile(r"^file-[0-9a-f]{24}$")  # checked before any id becomes a path
TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 24 * 3600  # a temporary file this old belongs to a crashed upload


class FileNotFound(LookupError):
    def __init__(self, file_id: str):
        super().__init__(f"No such File object: {file_id}")
        self.file_id = file_id


class FileTooLarge(ValueError):
    def __init__(self, max_bytes: int):
        super().__init__(f"the file is larger than the server's limit of {max_bytes} bytes")


@dataclass(frozen=True)
class FileRecord:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int
    project: str | None = None  # None: a file stored before projects existed (admin keys only)

    def to_openai(self) -> dict:
        fields = asdict(self)
        del fields["project"]
        return {**fields, "object": "file", "status": "processed", "status_details": None}


class FileStore:
    def __init__(self, root: str | os.PathLike, ttl_seconds: int, max_bytes: int):
        assert ttl_seconds >= 1 and max_bytes >= 1, (ttl_seconds, max_bytes)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.ttl_seconds = ttl_seconds
        self.max_bytes = max_bytes

    # --- writing -----------------------------------------------------------------------------------------------

    def save(self, source: BinaryIO, filename: str, purpose: str, project: str) -> FileRecord:
        """Copy `source` into a new file of `project`, piece by piece. Raises FileTooLarge past `max_bytes`."""
        with self.writer(filename, purpose, project) as out:
            num_bytes = 0
            while piece := source.read(COPY_PIECE_BYTES):
                num_bytes += len(piece)
                if num_bytes > self.max_bytes:
                    raise FileTooLarge(self.max_bytes)
                out.write(piece)
        assert out.record is not None, "a writer that exited cleanly has stored its file"
        return out.record

    @contextmanager
    def writer(
        self, filename: str, purpose: str, project: str | None, ttl_seconds: int | None = None
    ) -> Iterator[_Writer]:
        """A binary file to write; it becomes a stored file (`.record`) when the block exits without error."""
        file_id = f"file-{secrets.token_hex(12)}"
        tmp = self.root / f"{TMP_PREFIX}{file_id}"
        try:
            with open(tmp, "wb") as f:
                writer = _Writer(f)
                yield writer
            created_at = int(time.time())
            record = FileRecord(
                id=file_id,
                bytes=tmp.stat().st_size,
                created_at=created_at,
                filename=os.path.basename(filename) or "file.jsonl",
                purpose=purpose,
                expires_at=created_at + (ttl_seconds or self.ttl_seconds),
                project=project,
            )
            os.replace(tmp, self._data_path(file_id))
            self._write_record(record)
            writer.record = record
        finally:
            tmp.unlink(missing_ok=True)

    def _write_record(self, record: FileRecord) -> None:
        tmp = self.root / f"{TMP_PREFIX}{record.id}.json"
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, self._record_path(record.id))

    # --- reading -----------------------------------------------------------------------------------------------

    def get(self, file_id: str) -> FileRecord:
        """The record of a live file; raises FileNotFound (also for expired files and malformed ids)."""
        if not FILE_ID_RE.match(file_id):
            raise FileNotFound(file_id)
        try:
            record = FileRecord(**json.loads(self._record_path(file_id).read_text()))
        except (FileNotFoundError, ValueError, TypeError):
            raise FileNotFound(file_id) from None
        if record.expires_at <= time.time():
            raise FileNotFound(file_id)
        return record

    def data_path(self, file_id: str) -> Path:
        """Where the bytes of a live file are (for streaming them back)."""
        return self._data_path(self.get(file_id).id)

    def iter_lines(self, file_id: str) -> Iterator[bytes]:
        """The file's lines without their newline, read one at a time, as bytes: each line is decoded when it is
        validated, so a byte that is not UTF-8 fails its own line. A UTF-8 byte order mark at the start is dropped.
        """
        with open(self.data_path(file_id), "rb") as f:
            for line_no, line in enumerate(f, start=1):
                if line_no == 1 and line.startswith(UTF8_BOM):
                    line = line[len(UTF8_BOM) :]
                yield line.rstrip(b"\n")

    def leading_bytes(self, file_id: str, num_bytes: int) -> bytes:
        with open(self.data_path(file_id), "rb") as f:
            return f.read(num_bytes)

    def list(self, purpose: str | None = None, project: str | None = None) -> list[FileRecord]:
        """Live files (of `project`; None: of every project), newest first."""
        records = []
        for path in self.root.glob("file-*.json"):
            try:
                record = self.get(path.name.removesuffix(".json"))
            except FileNotFound:
                continue
            if (purpose is None or record.purpose == purpose) and (
                project is None or record.project == project
            ):
                records.append(record)
        return sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)

    # --- deleting ----------------------------------------------------------------------------------------------

    def delete(self, file_id: str) -> None:
        """Delete a live file; raises FileNotFound."""
        self.get(file_id)
        self._record_path(file_id).unlink(missing_ok=True)  # the record first: the file is gone from then on
        self._data_path(file_id).unlink(missing_ok=True)

    def remove_expired(self) -> int:
        """Delete expired files and leftovers of crashed writes. Returns how many files were deleted."""
        now = time.time()
        num_removed = 0
        for path in self.root.iterdir():
            file_id = path.name.removesuffix(".json")
            if path.name.endswith(".json") and FILE_ID_RE.match(file_id):
                try:
                    self.get(file_id)
                except FileNotFound:
                    path.unlink(missing_ok=True)
                    self._data_path(file_id).unlink(missing_ok=True)
                    num_removed += 1
            elif (path.name.startswith(TMP_PREFIX) or FILE_ID_RE.match(path.name)) and _is_orphan(path, now):
                path.unlink(missing_ok=True)  # a temporary file, or data whose record was never written
        return num_removed

    def _data_path(self, file_id: str) -> Path:
        return self.root / file_id

    def _record_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.json"


def _is_orphan(path: Path, now: float) -> bool:
    try:
        is_stale = path.stat().st_mtime < now - STALE_TMP_SECONDS
    except FileNotFoundError:  # deleted meanwhile (with its record, just above)
        return False
    return is_stale and not path.with_name(f"{path.name}.json").exists()


class _Writer:
    """What `FileStore.writer` yields: `write(bytes)`, and `record` once the file is stored."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.record: FileRecord | None = None

    def write(self, data: bytes) -> None:
        self._f.write(data)
