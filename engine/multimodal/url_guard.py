"""Fetching an image URL safely (the worker's side; the API never fetches): only http(s), every
address the host resolves to (and every redirect's) checked against loopback, private, link-local,
reserved and cloud-metadata ranges unless allowed, with limits on bytes, time and redirects. Torch-free."""

from __future__ import annotations

import ipaddress
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from engine.multimodal.images import ImageError
from settings import EngineSettings, value

METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "instance-data"})


@dataclass(frozen=True)
class FetchLimits:
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0
    max_redirects: int = 3
    # CIDR ranges (e.g. "127.0.0.1/32" for a test server) exempt from the address guard.
    allowed_networks: tuple[str, ...] = field(default_factory=tuple)


def env_allowed_networks() -> tuple[str, ...]:
    """CIDRs exempt from the guard by PAGEDBATCH_IMAGE_FETCH_ALLOW (comma separated; e.g. a test server)."""
    return tuple(n.strip() for n in value(EngineSettings, "image_fetch_allow").split(",") if n.strip())


def check_address(ip: str, allowed_networks=()) -> None:
    """Raise ImageError(url_forbidden) for an address a fetch must never reach."""
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if any(addr in ipaddress.ip_network(net, strict=False) for net in allowed_networks):
        return
    if (
        addr.is_loopback
        or addr.is_private
        or addr.is_link_local
        or addr.is_reserved
        or addr.is_multicast
        or addr.is_unspecified
        or str(addr) in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
        or addr in ipaddress.ip_network("100.64.0.0/10")
    ):
        raise ImageError("url_forbidden", f"image URL resolves to a forbidden address ({addr})")


def check_url(url: str, allowed_networks=()) -> tuple[str, int]:
    """The URL's host and port once its scheme, host and every resolved address pass the guard."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ImageError("invalid_image_url", f"image URLs must be http(s) or data: URLs, got {parts.scheme!r}")
    host = parts.hostname
    if not host:
        raise ImageError("invalid_image_url", "image URL has no host")
    if host.lower() in METADATA_HOSTS:
        raise ImageError("url_forbidden", f"image URL host {host!r} is a cloud metadata service")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ImageError("image_fetch_failed", f"cannot resolve {host!r}: {exc}") from None
    for info in infos:
        check_address(info[4][0], allowed_networks)
    return host, port


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # each hop is checked and followed by fetch_url itself


def fetch_url(url: str, limits: FetchLimits) -> bytes:
    """The body at `url` (following up to max_redirects checked redirects), at most max_bytes."""
    opener = urllib.request.build_opener(_NoRedirect)
    for _ in range(limits.max_redirects + 1):
        check_url(url, limits.allowed_networks)
        try:
            with opener.open(
                urllib.request.Request(url, headers={"User-Agent": "pagedbatch"}), timeout=limits.timeout_s
            ) as response:
                return _read_limited(response, limits.max_bytes)
        except urllib.error.HTTPError as exc:
            location = exc.headers.get("Location") if 300 <= exc.code < 400 else None
            if location is None:
                raise ImageError("image_fetch_failed", f"image URL answered HTTP {exc.code}") from None
            url = urllib.parse.urljoin(url, location)
        except (urllib.error.URLError, OSError) as exc:
            raise ImageError("image_fetch_failed", f"image URL could not be fetched: {exc}") from None
    raise ImageError("image_fetch_failed", f"image URL redirected more than {limits.max_redirects} times")


def _read_limited(response, max_bytes: int) -> bytes:
    length = response.headers.get("Content-Length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise ImageError("image_too_large", f"image is {int(length)} bytes; the limit is {max_bytes}")
    body = response.read(max_bytes + 1)
    if len(body) > max_bytes:
        raise ImageError("image_too_large", f"image is over the limit of {max_bytes} bytes")
    return body
