import io
import os
import time

import pytest

from producer.server.files import STALE_TMP_SECONDS, FileNotFound, FileStore, FileTooLarge


def test_save_get_list_delete(tmp_path):
    store = FileStore(tmp_path, ttl_seconds=60, max_bytes=10)
    record = store.save(io.BytesIO(b'{"a":1}\n'), "dir/in.jsonl", "batch")
    assert record.bytes == 8 and record.filename == "in.jsonl" and record.expires_at == record.created_at + 60
    assert store.get(record.id) == record
    assert store.data_path(record.id).read_bytes() == b'{"a":1}\n'
    assert list(store.iter_lines(record.id)) == ['{"a":1}']
    assert [r.id for r in store.list("batch")] == [record.id] and store.list("batch_output") == []
    store.delete(record.id)
    with pytest.raises(FileNotFound):
        store.get(record.id)
    assert sorted(os.listdir(tmp_path)) == []


def test_too_large_leaves_nothing_behind(tmp_path):
    store = FileStore(tmp_path, ttl_seconds=60, max_bytes=10)
    with pytest.raises(FileTooLarge):
        store.save(io.BytesIO(b"x" * 11), "big.jsonl", "batch")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("file_id", ["../etc/passwd", "file-xyz", "file-" + "0" * 23 + "/", ""])
def test_malformed_ids_never_become_paths(tmp_path, file_id):
    with pytest.raises(FileNotFound):
        FileStore(tmp_path, ttl_seconds=60, max_bytes=10).get(file_id)


def test_expired_files_and_stale_leftovers_are_removed(tmp_path):
    store = FileStore(tmp_path, ttl_seconds=60, max_bytes=100)
    with store.writer("out.jsonl", "batch_output", ttl_seconds=1) as out:
        out.write(b"{}\n")
    kept = store.save(io.BytesIO(b"{}\n"), "in.jsonl", "batch")
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
    with pytest.raises(RuntimeError), store.writer("out.jsonl", "batch_output") as out:
        out.write(b"{}\n")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == [] and out.record is None
