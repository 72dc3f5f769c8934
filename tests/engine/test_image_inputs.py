"""Image inputs without a model: decoding under limits, data URLs, and the URL guard (forbidden
addresses, redirect hops checked one by one, byte limits) against a local HTTP server."""

from __future__ import annotations

import functools
import http.server
import threading

import pytest

from engine.multimodal.images import ImageError, ImageLimits, decode_data_url, load_image
from engine.multimodal.url_guard import FetchLimits, check_address, fetch_url
from tests.vision_helpers import data_url, picture


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.0.0.8",
        "172.16.3.4",
        "192.168.0.1",
        "169.254.169.254",
        "::1",
        "fd00::1",
        "100.64.0.1",
        "0.0.0.0",
        "::ffff:127.0.0.1",
    ],
)
def test_forbidden_addresses(address):
    with pytest.raises(ImageError) as info:
        check_address(address)
    assert info.value.code == "url_forbidden"


def test_allowed_network_and_public_address():
    check_address("127.0.0.2", ("127.0.0.2/32",))
    check_address("93.184.216.34")


def test_data_urls_and_limits():
    image = picture(1, 40, 30)
    assert load_image(data_url(image)).size == (40, 30)
    with pytest.raises(ImageError, match="pixels") as info:
        load_image(data_url(image), ImageLimits(max_pixels=1000))
    assert info.value.code == "image_too_large"
    with pytest.raises(ImageError) as info:
        load_image("data:image/png;base64,aGVsbG8=")
    assert info.value.code == "invalid_image"
    with pytest.raises(ImageError) as info:
        decode_data_url("data:text/plain;base64,aGVsbG8=")
    assert info.value.code == "invalid_image_url"
    with pytest.raises(ImageError) as info:
        load_image("http://example.com/a.png")  # no fetcher: never fetched
    assert info.value.code == "url_forbidden"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.startswith("/to/"):  # /to/<url>: a redirect there
            self.send_response(302)
            self.send_header("Location", self.path[4:])
            self.end_headers()
            return
        body = b"x" * 5000
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.2", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.2:{srv.server_address[1]}"
    srv.shutdown()


def test_fetch_guard_redirects_and_bytes(server):
    allowed = FetchLimits(allowed_networks=("127.0.0.2/32",))
    assert len(fetch_url(f"{server}/image", allowed)) == 5000
    with pytest.raises(ImageError) as info:  # the server itself is loopback: refused unless allowed
        fetch_url(f"{server}/image", FetchLimits())
    assert info.value.code == "url_forbidden"
    with pytest.raises(ImageError) as info:  # a redirect to the metadata address: the hop is checked
        fetch_url(f"{server}/to/http://169.254.169.254/latest/meta-data/", allowed)
    assert info.value.code == "url_forbidden"
    hops = functools.reduce(lambda url, _: f"/to/{server}{url}", range(4), "/image")
    with pytest.raises(ImageError, match="redirected more than 3"):
        fetch_url(f"{server}{hops}", allowed)
    with pytest.raises(ImageError) as info:
        fetch_url(f"{server}/image", FetchLimits(max_bytes=100, allowed_networks=("127.0.0.2/32",)))
    assert info.value.code == "image_too_large"
    with pytest.raises(ImageError) as info:
        fetch_url("ftp://example.com/a.png", allowed)
    assert info.value.code == "invalid_image_url"
