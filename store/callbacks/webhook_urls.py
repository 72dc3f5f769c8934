"""Which webhook URLs may be called: http(s) only, and no loopback, private, link-local or otherwise special
address unless the operator allows it (`webhook_allow_loopback`, which the one-machine `serve` sets, and
`webhook_allow_private`). Checked when an endpoint is saved and again before each delivery (a name may
resolve elsewhere later)."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from store.errors import StoreError
from store.settings import Settings


class UrlRefused(StoreError):
    """A URL this deployment does not call (a 403: the policy refuses it, whatever the request's form)."""

    status = 403
    code = "url_not_allowed"


def check_url(settings: Settings, url: str, *, unresolved_ok: bool = False) -> None:
    """UrlRefused when `url` may not receive webhooks from this deployment. A host name that does not resolve
    now passes with `unresolved_ok` (when an endpoint is saved: it is checked again before each delivery)."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise UrlRefused(f"url is not a URL this deployment can call: {exc}", param="url") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UrlRefused("url must be an http or https URL with a host", param="url")
    try:
        infos = socket.getaddrinfo(parts.hostname, port, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError, ValueError) as exc:
        if unresolved_ok:
            return
        raise UrlRefused(f"url's host does not resolve: {exc}", param="url") from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%", 1)[0])
        refusal = _refusal(settings, address)
        if refusal:
            raise UrlRefused(f"url resolves to {address}, a {refusal} address, which this deployment does not "
                             "call (see PAGEDBATCH_WEBHOOK_ALLOW_LOOPBACK / _PRIVATE)", param="url")  # fmt: skip


def _refusal(settings: Settings, address) -> str | None:
    if getattr(address, "ipv4_mapped", None):
        address = address.ipv4_mapped
    if address.is_loopback:
        return None if settings.webhook_allow_loopback or settings.webhook_allow_private else "loopback"
    if address.is_unspecified or address.is_multicast or address.is_reserved:
        return "reserved"
    if address.is_link_local:  # cloud metadata services live here: never called
        return "link-local"
    if address.is_private:
        return None if settings.webhook_allow_private else "private"
    return None
