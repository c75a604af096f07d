"""free_port draws a server's port below the kernel's ephemeral range, so an outgoing connection
cannot take it as its source port before the server binds it, and never twice in one process."""
from __future__ import annotations

import socket

from pdserve.wire import transport


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    floor = transport._ephemeral_floor()
    ports = [transport.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if floor > 11024:  # else the range below is too narrow and the kernel picks
        assert all(10000 <= p < floor for p in ports), sorted(ports)[-3:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_is_passed_over(monkeypatch):
    """A port some server holds is never handed out: the draw moves on to the next."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = iter([taken, *range(40000, 40064)])
        monkeypatch.setattr(transport, "_ephemeral_floor", lambda: 65536)
        monkeypatch.setattr(transport._ports, "randrange", lambda lo, hi: next(draws))
        assert transport.free_port() != taken


def test_the_port_range_variable_narrows_the_draw(monkeypatch):
    """$PDSERVE_PORT_RANGE: the test suite's xdist workers each draw from their own slice (conftest),
    and so do the clusters they start, which inherit it."""
    monkeypatch.setenv(transport.PORT_RANGE_ENV, "20000-22000")
    assert transport.port_range() == (20000, min(22000, transport._ephemeral_floor()))
    ports = [transport.free_port() for _ in range(100)]
    assert all(20000 <= p < 22000 for p in ports), sorted(ports)
