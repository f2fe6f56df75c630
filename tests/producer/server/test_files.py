import io
import json
import os
import time

import pytest

from producer.server.files import STALE_TMP_SECONDS, FileNotFound, FileStore, FileTooLarge


def test_save_get_list_delete(tmp_path):
    store = FileStore(tmp_path, ttl_seconds=60, max_bytes=10)
    record = store.save(io.BytesIO(b'{"a":1}\n'), "dir/in.jsonl", "batch", "p1")
    assert record.bytes == 8 and record.filename == "in.jsonl" and record.expires_at == record.created_at + 60
    assert store.get(record.id) == record
    assert store.data_path(record.id).read_bytes() == b'{"a":1}\n'
    assert list(store.iter_lines(record.id)) == [b'{"a":1}']
    assert [r.id for r in store.list("batch")] == [record.id] and store.list("batch_output") == []
    assert [r.id for r in store.list("batch", "p1")] == [record.id] and store.list(None, "p2") == []
    assert record.project == "p1" and "project" not in record.to_openai()
    store.delete(record.id)
    with pytest.raises(FileNotFound):
        store.get(record.id)
    assert sorted(os.listdir(tmp_path)) == []


def test_too_large_leaves_nothing_behind(tmp_path):
    store = FileStore(tmp_path, ttl_seconds=60, max_bytes=10)
    with pytest.raises(FileTooLarge):
        store.save(io.BytesIO(b"x" * 11), "big.jsonl", "batch", "p1")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("file_id", ["../etc/passwd", "file-xyz", "file-" + "0" * 23 + "/", ""])
def test_malformed_ids_never_become_paths(tmp_path, file_id):
    with pytest.raises(FileNotFound):
        FileStore(tmp_path, ttl_seconds=60, max_bytes=10).get(file_id)


def test_expired_files_and_stale_leftovers_are_removed(tmp_path):
    store = FileStore(tmp_path, ttl_seconds=60, max_bytes=100)
    with store.writer("out.jsonl", "batch_output", "p1", ttl_seconds=1) as out:
        out.write(b"{}\n")
    kept = store.save(io.BytesIO(b"{}\n"), "in.jsonl", "batch", "p1")
    leftover = tmp_path / ".tmp-file-crashed"
    leftover.write_bytes(b"partial")
    old = time.time() - STALE_TMP_SECONDS - 1
    os.utime(leftover, (old, old))
    time.sleep(1.1)
    with pytest.raises(FileNotFound):
        store.get(out.record.id)
    assert store.remove_expired() == 1
    assert sorted(os.listdir(tmp_path)) == sorted([kept.id, f"{kept.id}.json"])


def test_a_failed_writer_stores_nothing(tmp_path):
    store = FileStore(tmp_path, ttl_seconds=60, max_bytes=100)
    with pytest.raises(RuntimeError), store.writer("out.jsonl", "batch_output", "p1") as out:
        out.write(b"{}\n")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == [] and out.record is None


def test_lines_stay_bytes_and_a_leading_utf8_bom_is_dropped(tmp_path):
    store = FileStore(tmp_path, ttl_seconds=60, max_bytes=100)
    data = b'\xef\xbb\xbf{"a":1}\r\n\xff\xfe\n\xef\xbb\xbf{}'
    record = store.save(io.BytesIO(data), "in.jsonl", "batch", "p1")
    # Only the file's first bytes are a byte order mark; a later one is the line's (invalid) content.
    assert list(store.iter_lines(record.id)) == [b'{"a":1}\r', b"\xff\xfe", b"\xef\xbb\xbf{}"]
    assert store.leading_bytes(record.id, 3) == b"\xef\xbb\xbf"


def test_records_written_before_projects_still_load(tmp_path):
    store = FileStore(tmp_path, ttl_seconds=60, max_bytes=100)
    record = store.save(io.BytesIO(b"{}\n"), "in.jsonl", "batch", "p1")
    path = tmp_path / f"{record.id}.json"
    old = json.loads(path.read_text())
    del old["project"]
    path.write_text(json.dumps(old))
    assert store.get(record.id).project is None and store.list(None, "p1") == []
