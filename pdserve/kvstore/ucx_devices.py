"""Which network device UCX (under NIXL) may listen on: the one holding the node's bind address.

A job of its own beside the NIXL agent wrapper (nixl_transfer): it runs before any agent exists,
from the node's start-up, and needs nothing of NIXL.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct


def interface_holding(ip: str) -> str | None:
    """The name of the network interface whose (primary IPv4) address is `ip`, or None."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None


def pin_ucx_to_host(host: str) -> str | None:
    """Keep UCX's listening sockets on the interface that holds `host` (lo for loopback).

    UCX, under NIXL, listens on every network device by default, so a node bound to 127.0.0.1
    would still accept connections on the machine's own interface address. A wildcard or
    unknown host changes nothing, and UCX_NET_DEVICES set by the user wins. Call before the
    first NIXL agent exists. Returns the device UCX is limited to, if any."""
    if host == "localhost":
        host = "127.0.0.1"
    device = interface_holding(host) if host.count(".") == 3 and host != "0.0.0.0" else None
    if device is not None:
        os.environ.setdefault("UCX_NET_DEVICES", device)
    return os.environ.get("UCX_NET_DEVICES") if device else None
