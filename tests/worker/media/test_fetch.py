"""worker/media/fetch.py: what an image URL may make the worker read or reach (data: URLs, files under the
allowed root, allowed hosts only, redirects included), each refusal naming the part."""

from __future__ import annotations

import os

import pytest

from tests.worker.media.conftest import data_url, image_bytes
from worker.media.fetch import read_image_bytes
from worker.media.policy import MediaError, MediaPolicy

PARAM = "messages[0].content[1].image_url.url"


def refused(url: str, policy: MediaPolicy) -> str:
    with pytest.raises(MediaError) as info:
        read_image_bytes(PARAM, url, policy)
    assert info.value.param == PARAM
    return str(info.value)


def test_a_data_url_gives_its_decoded_bytes_under_the_size_cap():
    png = image_bytes()
    assert read_image_bytes(PARAM, data_url(png), MediaPolicy()) == png
    assert "larger than this worker's 10 bytes" in refused(data_url(png), MediaPolicy(max_image_bytes=10))
    assert "not valid base64" in refused("data:image/png;base64,AB$C", MediaPolicy())
    assert "data:image/<type>;base64" in refused("data:text/plain;base64,AAAA", MediaPolicy())


def test_local_files_only_under_the_allowed_root_by_their_real_path(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (root / "a.png").write_bytes(b"inside")
    (outside / "secret.png").write_bytes(b"secret")
    os.symlink(outside / "secret.png", root / "link.png")  # a symlink inside the root leading out
    os.symlink(outside, root / "dir")
    policy = MediaPolicy(allowed_local_media_path=str(root))

    assert read_image_bytes(PARAM, f"file://{root}/a.png", policy) == b"inside"
    assert "without --allowed-local-media-path" in refused(f"file://{root}/a.png", MediaPolicy())
    for url in (
        f"file://{root}/link.png",
        f"file://{root}/dir/secret.png",
        f"file://{root}/../outside/secret.png",
        f"file://{root}/%2e%2e/outside/secret.png",
        "file:///etc/passwd",
    ):
        assert "outside the allowed local media path" in refused(url, policy), url
    assert "file:///absolute/path" in refused(f"file://otherhost{root}/a.png", policy)
    assert "not a regular file" in refused(f"file://{root}", policy)
    assert "cannot be read" in refused(f"file://{root}/missing.png", policy)
    (root / "big.png").write_bytes(b"x" * 100)
    small = MediaPolicy(allowed_local_media_path=str(root), max_image_bytes=99)
    assert "larger than" in refused(f"file://{root}/big.png", small)


def test_http_fetches_only_allowed_hosts_and_never_addresses(local_server):
    png = image_bytes()
    local_server.serve_bytes("/cat.png", png)
    allowed = MediaPolicy(allowed_media_domains=frozenset({"LocalHost"}))  # matched case-insensitively
    assert read_image_bytes(PARAM, local_server.url("/cat.png"), allowed) == png

    assert "localhost is not an allowed media domain (this worker fetches from none" in refused(
        local_server.url("/cat.png"), MediaPolicy()
    )
    assert "127.0.0.1 is an address" in refused(local_server.url("/cat.png", host="127.0.0.1"), allowed)
    assert "::1 is an address" in refused(f"http://[::1]:{local_server.port}/cat.png", allowed)
    assert "HTTP 404" in refused(local_server.url("/missing.png"), allowed)
    assert local_server.hits == ["/cat.png", "/missing.png"]  # nothing refused was ever requested


def test_redirects_are_followed_only_to_allowed_hosts(local_server):
    png = image_bytes()
    local_server.serve_bytes("/cat.png", png)
    local_server.redirect("/moved", "/cat.png")
    local_server.redirect("/away", local_server.url("/cat.png", host="127.0.0.1"))
    local_server.redirect("/elsewhere", "http://example.invalid/cat.png", status=307)
    local_server.redirect("/ftp", "ftp://localhost/cat.png")
    local_server.redirect("/loop", "/loop")
    allowed = MediaPolicy(allowed_media_domains=frozenset({"localhost"}))

    assert read_image_bytes(PARAM, local_server.url("/moved"), allowed) == png
    assert "127.0.0.1 is an address" in refused(local_server.url("/away"), allowed)
    assert "example.invalid is not an allowed media domain" in refused(local_server.url("/elsewhere"), allowed)
    assert "redirect to ftp" in refused(local_server.url("/ftp"), allowed)
    assert "more than 5 redirects" in refused(local_server.url("/loop"), allowed)


def test_an_http_image_over_the_size_cap_or_the_timeout_fails(local_server):
    local_server.serve_bytes("/big.png", b"x" * 5000)
    local_server.stall("/slow.png", seconds=3)
    policy = MediaPolicy(allowed_media_domains=frozenset({"localhost"}), max_image_bytes=4999)
    assert "larger than this worker's 4999 bytes" in refused(local_server.url("/big.png"), policy)

    quick = MediaPolicy(allowed_media_domains=frozenset({"localhost"}), fetch_timeout_seconds=0.5)
    assert "took longer than 0.5 s" in refused(local_server.url("/slow.png"), quick)


def test_the_policy_refuses_addresses_and_bad_roots_when_built(tmp_path):
    with pytest.raises(ValueError, match="host names, not addresses: 10.0.0.1"):
        MediaPolicy(allowed_media_domains=frozenset({"example.com", "10.0.0.1"}))
    with pytest.raises(ValueError, match="not a directory"):
        MediaPolicy(allowed_local_media_path=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="between 1 and 16"):
        MediaPolicy(max_images_per_request=17)
