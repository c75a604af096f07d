"""NIXL's UCX listens only on the interface of the node's address, never on the machine's own.

UCX opens a listening TCP socket on every network device by default: a node bound to 127.0.0.1
would still accept connections on the machine's interface address. pin_ucx_to_host (called by
every node before its engine and NIXL start) limits UCX to the device holding the bind address.
Each case runs in a fresh process: UCX reads UCX_NET_DEVICES once, when its context is created.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ray_util import machine_addresses

from pdserve.kvstore.nixl_transfer import nixl_import_error
from pdserve.kvstore.ucx_devices import interface_holding

if (_why := nixl_import_error()) is not None:
    pytest.skip(f"nixl not importable: {_why}", allow_module_level=True)

AGENT = """
import json, os, sys, torch
sys.path.insert(0, {tests!r})
from ray_util import listening_sockets
from pdserve.kvstore.nixl_transfer import NixlKVAgent
from pdserve.kvstore.ucx_devices import pin_ucx_to_host
if {pin!r}:
    pin_ucx_to_host({pin!r})
agent = NixlKVAgent("probe", torch.zeros(4, 64))
print(json.dumps([address for address, _ in listening_sockets(os.getpid())]))
"""


def _ucx_listens_on(pin: str | None) -> set[str]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    code = AGENT.format(tests=os.path.dirname(__file__), pin=pin)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_interface_holding():
    assert interface_holding("127.0.0.1") == "lo"
    assert interface_holding("203.0.113.77") is None  # TEST-NET-3: on no interface here


def test_a_node_on_loopback_keeps_ucx_off_the_machine_address():
    machine = machine_addresses() - {"127.0.0.1"}
    if not machine - {a for a in machine if ":" in a}:
        pytest.skip("this machine has no IPv4 interface address besides loopback")
    unpinned = _ucx_listens_on(None)
    # Without the pin UCX listens on the machine's address: what the pin is for (and proof that
    # this test would notice it gone).
    assert unpinned & machine, unpinned
    pinned = _ucx_listens_on("127.0.0.1")
    assert pinned and pinned <= {"127.0.0.1"}, pinned
