"""free_port draws a server's port below the kernel's ephemeral range, so an outgoing connection
cannot take it as its source port before the server binds it, never twice in one process, and
never twice on the machine while a server may still be starting."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

from pdserve.wire import port_ledger, transport


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


def test_two_processes_never_draw_the_same_port(tmp_path, monkeypatch):
    """Two launchers drawing at once (two `pdserve up`, the suite's clusters side by side): a port
    one process drew is never drawn by another while its server may still be starting, through the
    machine's ledger (pdserve.wire.port_ledger). 300 draws each from 1,100 ports: without the
    ledger some 80 would be drawn twice."""
    monkeypatch.setenv(port_ledger.LEDGER_ENV, str(tmp_path / "ledger"))
    monkeypatch.setenv(transport.PORT_RANGE_ENV, "20000-21100")
    other = subprocess.run([sys.executable, "-c", "from pdserve.wire.transport import free_port\n"
                            "print(' '.join(str(free_port()) for _ in range(300)))"],
                           capture_output=True, text=True, check=True, timeout=60)
    theirs = {int(p) for p in other.stdout.split()}
    ours = {transport.free_port() for _ in range(300)}
    assert len(theirs) == len(ours) == 300
    assert all(20000 <= p < 21100 for p in theirs | ours)
    assert not theirs & ours, f"drawn by both processes: {sorted(theirs & ours)[:5]}"


def test_a_claim_expires(tmp_path, monkeypatch):
    """A port claimed more than HOLD_S ago may be drawn again (its server bound it long since)."""
    monkeypatch.setenv(port_ledger.LEDGER_ENV, str(tmp_path / "ledger"))
    assert port_ledger.claim("127.0.0.1", 20001)
    assert not port_ledger.claim("127.0.0.1", 20001)
    now = time.time()
    monkeypatch.setattr(port_ledger.time, "time", lambda: now + port_ledger.HOLD_S + 1)
    assert port_ledger.claim("127.0.0.1", 20001)
    assert port_ledger.claim("127.0.0.1", 20002), "another port is unaffected"
