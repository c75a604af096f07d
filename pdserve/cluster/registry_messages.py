"""Typed messages between nodes, routers and the node registry (msgspec msgpack, no pickle).

Nodes send Register (at start and on every change), Heartbeat (every HEARTBEAT_S) and Deregister
(on a clean exit). The registry publishes Membership to every router on each change and every
HEARTBEAT_S, and answers a SnapshotRequest with the current Membership. Routers' admin requests
(ScaleRequest, SwitchRequest) go to the registry's owner and come back as an AdminReply.
"""
from __future__ import annotations

import msgspec

from pdserve.wire.compat import KVCompat

HEARTBEAT_S = 1.0
EXPIRE_AFTER_S = 3.0  # a record with no heartbeat for this long is dropped

ACTIVE = "active"
DRAINING = "draining"

# --registry URLs with these schemes keep the records in Redis (cluster/registry_redis.py); any
# other is the zmq registry's endpoint (cluster/registry.py).
REDIS_SCHEMES = ("redis://", "rediss://")


def is_redis_url(registry_url: str) -> bool:
    return registry_url.startswith(REDIS_SCHEMES)


class NodeRecord(msgspec.Struct, frozen=True):
    node_id: str
    role: str                       # "prefill" | "decode"
    control_addr: str               # tcp://host:port of the node's ROUTER socket, as routers reach it
    nixl_side_channel: str | None = None
    kv_salt: bytes = b""
    state: str = ACTIVE             # ACTIVE | DRAINING
    incarnation: int = 0            # a restarted node process registers a higher one
    # What its KV is, as at registration: a router refuses a node that would not pair before it
    # ever pongs (its pongs carry the current one, adapters loaded since included).
    compat: KVCompat | None = None


class Register(msgspec.Struct, tag=True):
    record: NodeRecord


class Heartbeat(msgspec.Struct, tag=True):
    node_id: str
    incarnation: int


class Deregister(msgspec.Struct, tag=True):
    node_id: str
    incarnation: int = 0            # 0: whatever incarnation is registered


class RegistryAck(msgspec.Struct, tag=True):
    """The registry's answer to a node: known=False asks the node to Register again (the
    registry restarted, or the record expired)."""
    known: bool = True


class SnapshotRequest(msgspec.Struct, tag=True):
    pass


class Membership(msgspec.Struct, tag=True):
    version: int                    # grows with every change; a router ignores older ones
    records: list[NodeRecord] = []
    epoch: int = 0                  # the registry process's start time: versions restart with it


class ScaleRequest(msgspec.Struct, tag=True):
    prefill: int | None = None
    decode: int | None = None


class SwitchRequest(msgspec.Struct, tag=True):
    node_id: str
    to_role: str


class AdminReply(msgspec.Struct, tag=True):
    ok: bool
    detail: str = ""


RegistryMessage = (Register | Heartbeat | Deregister | RegistryAck | SnapshotRequest | Membership
                   | ScaleRequest | SwitchRequest | AdminReply)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RegistryMessage)


def encode(msg: RegistryMessage) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> RegistryMessage:
    return _decoder.decode(data)
