"""Host names as both sides' HTTP faces read them (the coordinator's HTTP/JSON face, the MCP server's streamable
HTTP): loopback or not, an IP literal or a name. Here so that the HTTP guard (``inbox_wire.http_guard``), which
both use, needs nothing of either."""

from __future__ import annotations

import ipaddress

__all__ = ["is_ip", "is_loopback"]


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
