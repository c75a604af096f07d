"""Which registry a --registry URL names (zmq tcp:// or Redis), checked at start-up, and a
running node's registration there."""
from __future__ import annotations

import argparse
import time

import zmq

from pdserve.cluster.registration import NodeRegistration, advertised_endpoint
from pdserve.cluster.registry_messages import ACTIVE, NodeRecord, is_redis_url
from pdserve.kvstore.redact import redact_url


def registry_url(value: str) -> str:
    """`--registry`'s argparse type: a zmq tcp:// endpoint or a Redis URL, checked at start-up
    (a bad one would otherwise only show as a node no router ever finds)."""
    if is_redis_url(value):
        # deferred: redis and its asyncio client (~0.1 s) load only for a Redis registry
        from pdserve.cluster.registry_redis import connection
        try:
            connection(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    elif not value.startswith("tcp://"):
        raise argparse.ArgumentTypeError(f"{redact_url(value)}: use tcp://HOST:PORT (`pdserve registry`) "
                                         "or redis://HOST:PORT[/DB]")
    return value


def registration_class(url: str) -> type[NodeRegistration]:
    """The registration for a registry URL: Redis for redis:// and rediss://, else zmq."""
    if is_redis_url(url):
        # deferred: redis and its asyncio client (~0.1 s) load only for a Redis registry
        from pdserve.cluster.registry_redis import RedisNodeRegistration
        return RedisNodeRegistration
    return NodeRegistration


def register_node(node, url: str, advertise_host: str | None) -> NodeRegistration:
    """The registration of a running NodeRuntime (prefill or decode)."""
    control = advertised_endpoint(node.control.sock.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
    side = getattr(node, "side_channel", None) if getattr(node, "agent", None) is not None else None
    record = NodeRecord(node.node_id, node.role, control, side, node.engine.salt or b"",
                        incarnation=time.time_ns(), compat=node.compat.current())
    return registration_class(url)(url, record).start()


def keep_registered(node) -> None:
    """Called as a NodeRuntime starts serving: register it with its class's --registry, or, for
    the node that took over a registered one in a role switch, register the new role."""
    if not node.registry:
        return
    if node.registration is None:
        node.registration = register_node(node, node.registry, node.advertise_host)
        return
    side = getattr(node, "side_channel", None) if getattr(node, "agent", None) is not None else None
    node.registration.update(role=node.role, nixl_side_channel=side, state=ACTIVE)
