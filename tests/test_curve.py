"""CURVE on the node sockets, on real processes and sockets: `pdserve keys` writes usable key
files, a CURVE node answers only the router's key (no key, a stranger's key and the node key get
nothing, while the router's key gets a Pong), and `pdserve up --curve` serves exact output with
the NIXL side channel under CURVE too."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import psutil
import zmq
import zmq.auth

from pdserve import LLM
from pdserve.kvstore.nixl_transfer import nixl_import_error
from pdserve.testing.up_cluster import assert_greedy_matches_offline, node_stats, running_cluster, wait_for
from pdserve.wire.curve_keys import NodeKeys, RouterKeys
from pdserve.wire.messages import NixlMetadataRequest, Ping, Pong, decode, encode
from pdserve.wire.transport import free_port

SILENCE_S = 2.0  # how long an unauthorized client waits for an answer that must not come


def _pdserve(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *argv], capture_output=True, text=True, timeout=60, **kw)


def _keys(out) -> None:
    done = _pdserve("keys", "--out", str(out))
    assert done.returncode == 0, done.stderr


def test_keys_writes_loadable_pairs_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "keys"
    _keys(out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for name in ("router", "node"):
        public, secret = zmq.auth.load_certificate(out / f"{name}.key_secret")
        assert zmq.auth.load_certificate(out / f"{name}.key") == (public, None) and secret
        assert stat.S_IMODE((out / f"{name}.key_secret").stat().st_mode) == 0o600
    node, router = NodeKeys.load(out), RouterKeys.load(out)
    assert node.routers == {router.public} and router.server == node.public
    before = (out / "router.key_secret").read_bytes()

    again = _pdserve("keys", "--out", str(out))
    assert again.returncode == 2 and "--force" in again.stderr
    assert (out / "router.key_secret").read_bytes() == before
    forced = _pdserve("keys", "--out", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert RouterKeys.load(out).public != router.public


def _dealer(ctx: zmq.Context, address: str, keys: tuple[bytes, bytes, bytes] | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = keys
    sock.connect(address)
    return sock


def _silent(ctx: zmq.Context, address: str, clients: dict, request) -> None:
    """Every client sends `request`; none may hear anything within SILENCE_S (all wait at once)."""
    socks = {name: _dealer(ctx, address, keys) for name, keys in clients.items()}
    try:
        for sock in socks.values():
            sock.send(encode(request))
        time.sleep(SILENCE_S)
        answered = [name for name, sock in socks.items() if sock.poll(0)]
        assert not answered, f"answered without the right key: {answered}"
    finally:
        for sock in socks.values():
            sock.close(0)


def _pong_with_router_key(ctx: zmq.Context, address: str, router: RouterKeys, timeout_s: float) -> Pong:
    sock = _dealer(ctx, address, (router.secret, router.public, router.server))
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # the node may still be loading its engine
            sock.send(encode(Ping(1)))
            if sock.poll(500):
                return decode(sock.recv())
        raise AssertionError("the node never answered the router's key")
    finally:
        sock.close(0)


def _strangers(node: NodeKeys) -> dict:
    stranger_public, stranger_secret = zmq.curve_keypair()
    return {"no key": None, "unknown key": (stranger_secret, stranger_public, node.public),
            "node key": (node.secret, node.public, node.public)}


def test_curve_node_answers_only_the_routers_key(tmp_path):
    _keys(tmp_path)
    node, router = NodeKeys.load(tmp_path), RouterKeys.load(tmp_path)
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "--log-level", "WARNING", "decode",
                             "--model", "builtin:tiny", "--bind", address,
                             "--curve-dir", str(tmp_path), "--num-kv-blocks", "32"])
    ctx = zmq.Context()
    try:
        assert isinstance(_pong_with_router_key(ctx, address, router, 90), Pong)
        _silent(ctx, address, _strangers(node), Ping(2))
        # Still serving the router: the silence above was the keys, not a dead node.
        assert isinstance(_pong_with_router_key(ctx, address, router, 5), Pong)
    finally:
        ctx.destroy(0)
        proc.terminate()
        proc.wait(timeout=30)


def _cluster_commands(up_pid: int) -> list[list[str]]:
    return [c.cmdline() for c in psutil.Process(up_pid).children() if "pdserve" in " ".join(c.cmdline())]


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_up_with_curve_serves_exactly_and_keeps_strangers_out():
    transfer = "nixl" if nixl_import_error() is None else "store"
    prompt = [(13 * i) % 200 + 20 for i in range(40)]
    llm = LLM("builtin:tiny", num_kv_blocks=64)
    with running_cluster("--curve", "--kv-transfer", transfer, "--prefill-nodes", "1", "--decode-nodes", "1",
                         "--num-kv-blocks", "64") as (url, proc):
        commands = _cluster_commands(proc.pid)
        key_dirs = {_flag(cmd, "--curve-dir") for cmd in commands}
        assert len(commands) == 3 and len(key_dirs) == 1, commands  # router and both nodes, one key dir
        key_dir = key_dirs.pop()
        assert stat.S_IMODE(os.stat(key_dir).st_mode) == 0o700
        assert_greedy_matches_offline(url, llm, prompt, 8)
        wait_for(lambda: node_stats(url)["decode-0"][f"transfer_bytes_{transfer}"] > 0)
        assert node_stats(url)["decode-0"]["transfers_failed"] == 0
        node = NodeKeys.load(key_dir)
        ctx = zmq.Context()
        try:
            decode_node = next(cmd for cmd in commands if "decode" in cmd)
            _silent(ctx, _flag(decode_node, "--bind"), _strangers(node), Ping(1))
            if transfer == "nixl":  # the side channel admits the node key only (it carried the pull above)
                prefill = next(cmd for cmd in commands if "prefill" in cmd)
                stranger_public, stranger_secret = zmq.curve_keypair()
                _silent(ctx, _flag(prefill, "--nixl-side-channel"),
                        {"no key": None, "unknown key": (stranger_secret, stranger_public, node.public)},
                        NixlMetadataRequest())
        finally:
            ctx.destroy(0)
    assert not os.path.exists(key_dir), "pdserve up left its keys behind"
