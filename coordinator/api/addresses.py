"""Network addresses as the coordinator's settings and the HTTP face read them: ``HOST:PORT``, loopback, IP
literals. Below the configuration (coordinator.ops.config) so that the API layer reads them without it."""

from __future__ import annotations

from inbox_wire.addresses import is_ip, is_loopback

__all__ = ["is_ip", "is_loopback", "parse_host_port"]


def parse_host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) to its parts; ValueError names the problem."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("not HOST:PORT (a port from 0 to 65535; [::1]:PORT for IPv6)")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError("an IPv6 address needs brackets: [::1]:PORT")
    return host, int(port)
