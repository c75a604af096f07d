"""ZeroMQ CURVE keys for the nodes' sockets: `pdserve keys` writes them, nodes and routers load them.

A key directory, as `pdserve keys --out DIR` writes it (pyzmq's ZPL certificate files):
    router.key, router.key_secret   the router's pair: its DEALERs are CURVE clients
    node.key, node.key_secret       one pair shared by every node: their ROUTERs are CURVE servers
A node host needs router.key and node.key_secret; a router host needs router.key_secret and
node.key. A node accepts on its control socket only the public keys in `router*.key` files (a
second router: drop its router-b.key beside the first), and on its NIXL side channel only the
node key (decode nodes dial it as clients with the node pair).
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ROUTER, NODE = "router", "node"
CONTROL_DOMAIN = "control"  # a node's control socket: the router's keys only
PEER_DOMAIN = "peer"        # node-to-node sockets (the NIXL side channel): the node key only


def write_keys(out: str | os.PathLike, force: bool = False) -> list[Path]:
    """Write the router and node key pairs into `out` (created 0700); the files written."""
    out = Path(out)
    existing = [out / f"{name}.key_secret" for name in (ROUTER, NODE) if (out / f"{name}.key_secret").exists()]
    if existing and not force:
        raise ValueError(f"{', '.join(map(str, existing))} already exist: a new pair would lock out every "
                         "host holding the old one (pass --force to replace them)")
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    written = []
    umask = os.umask(0o077)  # no moment when a new secret file is readable by others
    try:
        for name in (ROUTER, NODE):
            public, secret = (Path(p) for p in zmq.auth.create_certificates(out, name))
            secret.chmod(0o600)  # an overwritten (--force) file keeps its old mode
            public.chmod(0o644)
            written += [public, secret]
    finally:
        os.umask(umask)
    return written


def _load(path: Path, need_secret: bool, role: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"a {role} needs {path} (`pdserve keys --out {path.parent}` writes it): {exc}") from None
    if need_secret and secret is None:
        raise ValueError(f"{path} holds no secret key")
    return public, secret


@dataclass(frozen=True)
class NodeKeys:
    public: bytes
    secret: bytes
    routers: frozenset[bytes]  # the public keys allowed on the control socket

    @classmethod
    def load(cls, key_dir: str | os.PathLike) -> NodeKeys:
        key_dir = Path(key_dir)
        public, secret = _load(key_dir / f"{NODE}.key_secret", True, "node")
        routers = frozenset(_load(Path(p), False, "node")[0] for p in glob.glob(str(key_dir / f"{ROUTER}*.key")))
        if not routers:
            raise ValueError(f"a node needs the router's public key in {key_dir / ROUTER}.key")
        return cls(public, secret, routers)


@dataclass(frozen=True)
class RouterKeys:
    public: bytes
    secret: bytes
    server: bytes  # the nodes' public key

    @classmethod
    def load(cls, key_dir: str | os.PathLike) -> RouterKeys:
        key_dir = Path(key_dir)
        public, secret = _load(key_dir / f"{ROUTER}.key_secret", True, "router")
        return cls(public, secret, _load(key_dir / f"{NODE}.key", False, "router")[0])

    def apply(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE client of the nodes (before it connects)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server


class CurveContext(zmq.Context):
    """A node's context under CURVE. Its sockets default to CURVE clients holding the node pair
    (so a decode node's NIXL side-channel DEALER needs no code of its own); NodeSocket turns the
    ones a node binds into servers."""
    keys: NodeKeys  # annotated: pyzmq's Context only accepts attributes its class declares
    authenticator: ThreadAuthenticator


class _Allowed:
    """ZAP callback: a client key passes only in the domain it was issued for."""

    def __init__(self, keys: NodeKeys):
        # load_certificate's keys and the ones ZAP passes here are both Z85 text.
        self.by_domain = {CONTROL_DOMAIN: keys.routers, PEER_DOMAIN: {keys.public}}

    def callback(self, domain: str, z85_key: bytes) -> bool:
        return z85_key in self.by_domain.get(domain, ())


def node_context(keys: NodeKeys) -> CurveContext:
    # Without a ZAP handler libzmq admits any client that knows the server key, so the
    # authenticator starts before any node socket exists.
    ctx = CurveContext()
    ctx.keys = keys
    ctx.authenticator = ThreadAuthenticator(ctx)
    ctx.authenticator.start()
    allowed = _Allowed(keys)
    for domain in (CONTROL_DOMAIN, PEER_DOMAIN):
        ctx.authenticator.configure_curve_callback(domain, allowed)
    # Defaults only now: the authenticator's own inproc sockets must stay plain.
    ctx.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    ctx.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    ctx.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
    return ctx


def make_server(sock: zmq.Socket, ctx: zmq.Context, domain: str) -> None:
    """Make a socket about to bind a CURVE server admitting `domain`'s keys, if `ctx` is a CurveContext."""
    if isinstance(ctx, CurveContext):
        sock.curve_secretkey = ctx.keys.secret
        sock.curve_server = True  # after the context's client defaults: the last setting wins
        sock.zap_domain = domain.encode()


def run_keys(args) -> int:
    """`pdserve keys`."""
    for path in write_keys(args.out, args.force):
        print(f"wrote {path}")
    print(f"node hosts need {ROUTER}.key and {NODE}.key_secret; router hosts need {ROUTER}.key_secret "
          f"and {NODE}.key; pass the directory with --curve-dir")
    return 0
