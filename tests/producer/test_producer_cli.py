import json

import pytest
from click.testing import CliRunner
from rq import Queue
from rq.serializers import JSONSerializer

from producer import settings
from producer.cli import EXIT_REDIS_UNREACHABLE, main


@pytest.fixture
def cbq(conn, monkeypatch):
    """Run `cbq ARGS...` in-process against the test's Redis (whatever --redis-url says)."""
    monkeypatch.setattr(settings, "connect", lambda url, **options: conn)
    runner = CliRunner()

    def invoke(*args, input=None):
        return runner.invoke(main, list(args), input=input, catch_exceptions=False)

    return invoke


def write_jsonl(tmp_path, objs, name="in.jsonl"):
    path = tmp_path / name
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return str(path)


def queue_count(conn, name="cbq"):
    return Queue(name, connection=conn, serializer=JSONSerializer).count


def test_submit_prints_the_batch_id_and_json_last_line(cbq, conn, tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}]}])
    plain = cbq("submit", path)
    assert plain.exit_code == 0
    assert len(plain.stdout.strip()) == 16  # just the batch id on stdout
    assert "submitted 2 requests in 1 chunks to queue cbq" in plain.stderr

    as_json = cbq("submit", path, "--json", "--chunk-size", "1", "--queue", "other")
    record = json.loads(as_json.stdout.strip().splitlines()[-1])
    assert record["num_requests"] == 2 and record["num_chunks"] == 2 and record["queue"] == "other"
    assert queue_count(conn, "other") == 2


def test_invalid_file_enqueues_nothing_and_reports_every_bad_line(cbq, conn, tmp_path):
    path = write_jsonl(
        tmp_path,
        [
            {"prompt": "ok"},
            {"prompt": "x", "temperature": -1},
            "not json",
            {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 300}},
            {"prompt": "dup", "custom_id": "d"},
            {"prompt": "dup", "custom_id": "d"},
        ],
    )
    result = cbq("submit", path)
    assert result.exit_code == 1
    assert "line 3: invalid JSON" in result.stderr
    assert "line 6: custom_id: duplicate custom_id 'd' (first on line 5)" in result.stderr
    assert "2 invalid line(s); nothing was enqueued" in result.stderr
    assert queue_count(conn) == 0 and not conn.keys("cbq:*")

    strict = cbq("submit", path, "--strict")  # the invalid requests refuse the file too
    assert "line 2: temperature: Input should be greater than or equal to 0" in strict.stderr
    assert "line 4: body.n: Input should be less than or equal to 128" in strict.stderr
    assert "4 invalid line(s); nothing was enqueued" in strict.stderr
    assert queue_count(conn) == 0 and not conn.keys("cbq:*")

    as_json = cbq("submit", path, "--strict", "--json")
    record = json.loads(as_json.stdout.strip().splitlines()[-1])
    assert record["batch_id"] is None and [e["line"] for e in record["errors"]] == [2, 3, 4, 6]


def test_an_invalid_request_fails_alone_and_the_valid_ones_are_enqueued(cbq, conn, tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "ok"}, {"prompt": 5}, {"prompt": "ok too"}])
    result = cbq("submit", path, "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["num_requests"] == 3 and record["num_invalid"] == 1
    assert [e["line"] for e in record["errors"]] == [2]
    assert "line 2: prompt: Input should be a valid string (this request fails with status 400" in result.stderr
    status = json.loads(cbq("status", record["batch_id"], "--json").stdout)
    assert (status["num_failed"], status["num_queued"]) == (1, 2)

    removed = cbq("submit", path, "--skip-invalid")
    assert removed.exit_code == 2 and "--skip-invalid was removed" in removed.stderr and "--strict" in removed.stderr


def test_submit_from_stdin_and_bad_flags(cbq, conn):
    ok = cbq("submit", "-", "--max-new-tokens", "4", "--stop", "a", "--stop", "b", input='{"prompt": "x"}\n')
    assert ok.exit_code == 0
    bad = cbq("submit", "-", "--temperature", "-2", input='{"prompt": "x"}\n')
    assert bad.exit_code == 2
    assert "Invalid value for '--temperature': -2.0 is not in the range 0<=x<=100.0" in bad.stderr
    long_stop = cbq("submit", "-", "--stop", "s" * 257, input='{"prompt": "x"}\n')  # a bound click cannot see
    assert long_stop.exit_code == 2
    assert "Invalid value for --stop: String should have at most 256 characters" in long_stop.stderr
    empty = cbq("submit", "-", input="\n\n")
    assert empty.exit_code == 1 and "no requests in the input" in empty.stderr
    timeout = cbq("submit", "-", "--job-timeout", "0", input='{"prompt": "x"}\n')
    assert timeout.exit_code == 2 and "--job-timeout" in timeout.stderr


def test_resubmission_under_a_name_reports_skipped_ids(cbq, tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "a", "custom_id": "x"}])
    assert cbq("submit", path, "--name", "n").exit_code == 0
    again = cbq("submit", path, "--name", "n", "--json")
    assert "skipped 1 already submitted under --name n: x" in again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["batch_id"] is None


def test_status_results_and_cancel_without_a_worker(cbq, conn, tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": f"p{i}", "custom_id": f"c{i}"} for i in range(5)])
    batch_id = cbq("submit", path, "--chunk-size", "2").stdout.strip()

    status = json.loads(cbq("status", batch_id, "--json").stdout)
    assert (status["num_queued"], status["state"], status["is_done"]) == (5, "queued", False)
    assert "total 5  queued 5  running 0" in cbq("status", batch_id).stdout

    early = cbq("results", batch_id)
    assert (
        early.exit_code == 1 and "has 5 unfinished requests" in early.stderr and "--partial" in early.stderr
    )
    assert cbq("results", batch_id, "--partial").stdout == ""

    cancelled = json.loads(cbq("cancel", batch_id, "--json").stdout)
    assert cancelled == {
        "batch_id": batch_id,
        "num_chunks_dequeued": 3,
        "num_requests_cancelled": 5,
        "num_requests_aborting": 0,
        "already_finished": False,
    }
    assert queue_count(conn) == 0
    status = json.loads(cbq("status", batch_id, "--json").stdout)
    assert (status["num_cancelled"], status["state"]) == (5, "cancelled")

    out = tmp_path / "out.jsonl"
    written = cbq("results", batch_id, "-o", str(out))
    assert f"wrote 5 results to {out}" in written.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["custom_id"], r["finish_reason"]) for r in lines] == [
        (i, f"c{i}", "cancelled") for i in range(5)
    ]
    openai = [json.loads(line) for line in cbq("results", batch_id, "--format", "openai").stdout.splitlines()]
    assert openai[0]["error"]["code"] == "cancelled" and openai[0]["custom_id"] == "c0"

    waited = cbq("wait", batch_id, "--interval", "0.05")
    assert waited.exit_code == 2  # finished, but not every request completed
    assert "cancelled 5" in waited.stdout


def test_wait_times_out(cbq, tmp_path):
    batch_id = cbq("submit", write_jsonl(tmp_path, [{"prompt": "a"}])).stdout.strip()
    result = cbq("wait", batch_id, "--interval", "0.05", "--timeout", "0.1")
    assert result.exit_code == 1 and "timed out: 1 requests unfinished" in result.stderr


def test_unknown_batch_is_a_clear_error(cbq):
    for command in ("status", "results", "cancel", "wait"):
        result = cbq(command, "nope")
        assert result.exit_code == 1
        assert "no batch 'nope' (never submitted, or its results expired)" in result.stderr


def test_stats_lists_batches(cbq, tmp_path):
    batch_id = cbq("submit", write_jsonl(tmp_path, [{"prompt": "a"}])).stdout.strip()
    record = json.loads(cbq("stats", "--json").stdout)
    assert record["workers"] == [] and record["batches"][0]["batch_id"] == batch_id
    assert batch_id in cbq("stats").stdout


def test_large_files_show_progress(cbq, fake_redis, tmp_path):
    # validation's bar counts bytes (from 1 MiB), storing's counts requests (from 5,000)
    path = write_jsonl(tmp_path, [{"prompt": f"p{i} " + "x" * 200} for i in range(6000)])
    result = cbq("submit", path, "--json")
    assert json.loads(result.stdout.strip().splitlines()[-1])["num_requests"] == 6000
    assert "validating" in result.stderr and "storing" in result.stderr


def test_lines_split_on_newlines_only(cbq, conn, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a\u2028b\u0085c"}\r\n{"prompt": "d"}\n', encoding="utf-8")
    record = json.loads(cbq("submit", str(path), "--json").stdout.splitlines()[-1])
    assert record["num_requests"] == 2


def test_result_ttl_comes_from_the_environment(conn, monkeypatch, tmp_path):
    monkeypatch.setattr(settings, "connect", lambda url, **options: conn)
    path = write_jsonl(tmp_path, [{"prompt": "a"}])
    result = CliRunner(env={"CBQ_RESULT_TTL": "321"}).invoke(main, ["submit", path])
    batch_id = result.stdout.strip()
    assert 300 < conn.ttl(f"cbq:batch:{batch_id}") <= 321


def test_redis_url_comes_from_the_environment():
    result = CliRunner(env={"CBQ_REDIS_URL": "redis://127.0.0.1:1/3"}).invoke(main, ["stats"])
    assert result.exit_code == 1 and "cannot reach Redis at redis://127.0.0.1:1/3" in result.stderr


def test_unreachable_redis_is_a_clear_error():
    url = "redis://:secret@127.0.0.1:1/0"
    result = CliRunner().invoke(main, ["status", "b", "--redis-url", url, "--redis-outage-limit", "0"])
    assert result.exit_code == EXIT_REDIS_UNREACHABLE
    assert "cannot reach Redis at redis://:***@127.0.0.1:1/0" in result.stderr
    assert "secret" not in result.stderr


def test_redis_urls_with_password_and_tls_are_accepted():
    tls = settings.connect("rediss://:pw@example.com:6380/2")
    kwargs = tls.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["password"]) == (
        "example.com",
        6380,
        2,
        "pw",
    )
    assert tls.connection_pool.connection_class.__name__ == "SSLConnection"
    assert settings.redact_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"


def test_bench_is_mounted_lazily():
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0


def test_a_file_edited_during_submit_is_one_clear_error_and_enqueues_nothing(cbq, conn, tmp_path, monkeypatch):
    # The file is read twice (validated, then stored); an edit in between must not enqueue a mix of both.
    import producer.cli as cli_module

    path = write_jsonl(tmp_path, [{"prompt": f"p{i}", "custom_id": f"c{i}"} for i in range(20)])
    validate = cli_module._validate_with_progress

    def validate_then_edit(client, reopen, size):
        validated = validate(client, reopen, size)
        write_jsonl(tmp_path, [{"prompt": f"p{i}", "custom_id": f"other{i}"} for i in range(20)])
        return validated

    monkeypatch.setattr(cli_module, "_validate_with_progress", validate_then_edit)
    result = cbq("submit", path)
    assert result.exit_code == 1
    assert "the input changed after it was validated (line 1)" in result.stderr
    assert "Traceback" not in result.output
    assert queue_count(conn) == 0 and not list(conn.scan_iter("cbq:batch:*"))


def publish_worker(conn, queues, updated_ago=0.0, state="idle"):
    import time

    from producer.store import publish_worker_stats
    from schemas.status import WorkerStats

    now = time.time()
    stats = WorkerStats(
        worker_name="w1",
        hostname="h",
        pid=1,
        model="m",
        queues=queues,
        started_at=now - 60,
        updated_at=now - updated_ago,
        state=state,
    )
    publish_worker_stats(conn, stats)


def test_status_and_wait_say_when_no_live_worker_serves_the_queue(cbq, conn, tmp_path):
    batch_id = cbq("submit", write_jsonl(tmp_path, [{"prompt": "a"}])).stdout.strip()
    none = "no live worker serves queue cbq: nothing runs until one starts (`cbq worker --queue cbq`"
    assert none in cbq("status", batch_id).stdout
    assert json.loads(cbq("status", batch_id, "--json").stdout)["num_live_workers"] == 0
    waited = cbq("wait", batch_id, "--interval", "0.05", "--timeout", "0.2")
    assert waited.exit_code == 1 and none in waited.stderr

    for queues, ago, state in ((["other"], 0, "idle"), (["cbq"], 45, "busy"), (["cbq"], 0, "stopped")):
        publish_worker(conn, queues, ago, state)  # another queue's, silent for 45 s, or stopped: not live
        assert none in cbq("status", batch_id).stdout, (queues, ago, state)
    publish_worker(conn, ["other", "cbq"])
    assert "no live worker" not in cbq("status", batch_id).stdout
    assert json.loads(cbq("status", batch_id, "--json").stdout)["num_live_workers"] == 1
    waited = cbq("wait", batch_id, "--interval", "0.05", "--timeout", "0.2")
    assert waited.exit_code == 1 and "no live worker" not in waited.stderr


def test_result_files_keep_one_line_per_result_when_text_holds_line_separators(tmp_path):
    """Sampled text from a byte-level vocabulary can hold U+0085, U+2028 and U+2029, which JSON may leave raw but
    str.splitlines() (and some JSONL readers) split on: the written file escapes them, the values round-trip."""
    import json

    from producer.cli_common import write_result_lines
    from schemas.result import ResultLine

    texts = ["a\x85b", "c\u2028d", "e\u2029f", "plain"]
    lines = iter([ResultLine(index=i, text=t, finish_reason="length") for i, t in enumerate(texts)])
    out = tmp_path / "out.jsonl"
    assert write_result_lines(str(out), lines, "cbq") == (4, 0)
    written = out.read_text(encoding="utf-8")
    assert [json.loads(line)["text"] for line in written.splitlines()] == texts


def test_submit_notes_the_sampling_flags_that_lines_override(cbq, tmp_path):
    lines = [{"prompt": "a", "max_tokens": 3, "temperature": 0.5}, {"prompt": "b", "temperature": 0.7}, {"prompt": "c"}]
    result = cbq("submit", write_jsonl(tmp_path, lines), "--max-new-tokens", "8", "--temperature", "0.7")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: --max-new-tokens 8 is a default: 1 line(s) give their own max_new_tokens (or max_tokens), which wins",
        "note: --temperature 0.7 is a default: 1 line(s) give their own temperature, which wins",
    ]
    quiet = cbq("submit", write_jsonl(tmp_path, lines, "b.jsonl"))
    assert quiet.exit_code == 0 and "note:" not in quiet.stderr
