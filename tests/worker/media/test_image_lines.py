"""Chat lines with images through `cbq run` (the fake engine takes images, as a vision model does) and a
text-only engine: every bad image fails its own line as an invalid request naming the part, the others run;
OpenAI's output reports the failure as a 400."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from producer.cli import main
from tests.worker.media.conftest import data_url, gif_two_frames, image_bytes

pytestmark = pytest.mark.usefixtures("restore_signal_handlers")  # rq installs its own


def chat_line(custom_id: str, *urls: str) -> dict:
    content = [{"type": "text", "text": "Describe:"}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
    body = {"model": "fake", "messages": [{"role": "user", "content": content}], "max_tokens": 64}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def run(tmp_path, lines: list[dict], *flags: str) -> dict[str, dict]:
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ran = CliRunner().invoke(
        main,
        ["run", str(path), "-o", str(out), "--format", "openai", "--fake-engine", "--served-model-name", "fake", *flags],
    )
    assert ran.exit_code in (0, 2), ran.output
    return {line["custom_id"]: line["response"] for line in map(json.loads, out.read_text().splitlines())}


def error_of(response: dict) -> tuple[str, str, str]:
    assert response["status_code"] == 400, response
    error = response["body"]["error"]
    assert error["type"] == "invalid_request_error"
    return error["param"], error["code"], error["message"]


def test_images_from_data_urls_files_and_allowed_hosts_run_and_bad_ones_fail_alone(tmp_path, local_server):
    root = tmp_path / "media"
    root.mkdir()
    (root / "scan.jpg").write_bytes(image_bytes("JPEG"))
    (tmp_path / "secret.png").write_bytes(image_bytes())
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    local_server.serve_bytes("/cat.webp", image_bytes("WEBP"), "image/webp")
    local_server.serve_bytes("/broken.png", image_bytes("JPEG", size=(64, 64))[:300])
    local_server.stall("/slow.png", seconds=3)
    png = image_bytes()
    lines = [
        chat_line("two", data_url(png), data_url(gif_two_frames(), "image/gif")),
        chat_line("file", f"file://{root}/scan.jpg"),
        chat_line("http", local_server.url("/cat.webp")),
        chat_line("escape", data_url(png), f"file://{root}/escape.png"),
        chat_line("domain", "https://example.com/cat.png"),
        chat_line("truncated", local_server.url("/broken.png")),
        chat_line("slow", local_server.url("/slow.png")),
        chat_line("garbage", data_url(b"GIF89a but not really")),
        chat_line("too-many", *[data_url(png)] * 3),
    ]
    flags = ["--allowed-local-media-path", str(root), "--allowed-media-domains", "localhost",
             "--media-fetch-timeout", "0.5", "--limit-mm-per-prompt", '{"image": 2}']  # fmt: skip
    responses = run(tmp_path, lines, *flags)

    for custom_id, num_images in (("two", 2), ("file", 1), ("http", 1)):
        assert responses[custom_id]["status_code"] == 200
        text = responses[custom_id]["body"]["choices"][0]["message"]["content"]
        assert text.count("<image>") == num_images, text  # the fake engine echoes its byte template
    url_of = "messages[0].content[{}].image_url.url".format
    expected = {
        "escape": (url_of(2), "is outside the allowed local media path"),
        "domain": (url_of(1), "example.com is not an allowed media domain (allowed: localhost)"),
        "truncated": (url_of(1), "truncated or corrupt"),
        "slow": (url_of(1), "took longer than 0.5 s"),
        "garbage": (url_of(1), "not a PNG, JPEG, WebP or GIF"),
        "too-many": (url_of(3), "3 images in one request; this worker takes at most 2"),
    }
    for custom_id, (param, message) in expected.items():
        got_param, code, got_message = error_of(responses[custom_id])
        assert (got_param, code) == (param, "invalid_value"), custom_id
        assert message in got_message, (custom_id, got_message)


def test_without_flags_only_data_urls_are_read(tmp_path, local_server):
    (tmp_path / "a.png").write_bytes(image_bytes())
    local_server.serve_bytes("/a.png", image_bytes())
    lines = [chat_line("data", data_url(image_bytes())), chat_line("file", f"file://{tmp_path}/a.png"),
             chat_line("http", local_server.url("/a.png"))]  # fmt: skip
    responses = run(tmp_path, lines)
    assert responses["data"]["status_code"] == 200
    assert "without --allowed-local-media-path" in error_of(responses["file"])[2]
    assert "localhost is not an allowed media domain (this worker fetches from none" in error_of(responses["http"])[2]
    assert local_server.hits == []


def test_a_bad_flag_is_a_usage_error(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(chat_line("a", data_url(image_bytes()))) + "\n")
    for flags, message in (
        (["--allowed-media-domains", "10.1.2.3"], "host names, not addresses"),
        (["--limit-mm-per-prompt", '{"video": 1}'], 'only {"image": N} is taken'),
        (["--limit-mm-per-prompt", '{"image": 99}'], "between 1 and 16"),
    ):
        ran = CliRunner().invoke(main, ["run", str(path), "-o", str(tmp_path / "o"), "--fake-engine", *flags])
        assert ran.exit_code == 2 and message in ran.output, ran.output
