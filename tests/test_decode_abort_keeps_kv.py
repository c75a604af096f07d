"""A decode node whose request is aborted while the prompt's KV is still landing keeps that KV.

The router credits a decode node with a prompt's blocks the moment it sends the request there,
so the next request with that prefix goes to the same node. If the client leaves while the
node is still loading the prompt from the store, the node used to free the blocks uncached, and
the router's credit pointed at nothing: the next request recomputed the whole prefix there.

A real decode node (engine, zmq ROUTER socket, the LMCache store over a real redis-server) serves
on loopback in a thread; a DEALER plays the router. The prompt's KV comes from a second engine
that computed it and put it in Redis through a store of its own, as a prefill node does.
The node's one store-fetch thread is kept busy until the abort has arrived, so the abort lands
while the fetch is in flight, every time.
"""
from __future__ import annotations

import threading
import time

import pytest
import zmq
from node_thread import serving_in_thread

from pdserve.assembly.build import build_engine
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.kvstore.factory import make_store
from pdserve.kvstore.layout import KVLayout
from pdserve.node.decode import DecodeNode, PullState
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.redis_server import redis_server
from pdserve.testing.up_cluster import wait_for
from pdserve.wire.handover import StoreHandover
from pdserve.wire.messages import Abort, DecodeRequest, decode, encode, token_outputs
from pdserve.wire.transport import free_port

PROMPT = [(i * 37) % 250 + 3 for i in range(100)]  # 6 full blocks of 16 and a partial one
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _engine() -> LLMEngine:
    return build_engine(EngineConfig(model="builtin:tiny", num_kv_blocks=64))


def _store(url: str, engine: LLMEngine):
    return make_store(url, layout=KVLayout.from_cache(engine.kv_cache, "builtin:tiny"))


def _prefill_into(url: str) -> tuple[list[bytes], int]:
    """Compute the prompt on another engine and put its blocks in Redis, as a prefill node does;
    returns the block keys and the first token."""
    engine = _engine()
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=1, temperature=0), hold_blocks=True)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first = out.new_token_ids[0]
    held = engine.scheduler.held["p"]
    bs = engine.config.block_size
    keys = engine.kv.block_keys(held)[: len(PROMPT) // bs]
    store = _store(url, engine)
    try:
        store.put(keys, engine.kv_cache, held.block_ids[: len(keys)], [bs] * len(keys))
    finally:
        store.close()
    return keys, first


@pytest.fixture
def decode_node():
    with redis_server() as (url, _proc):
        engine = _engine()
        port = free_port()
        node = DecodeNode(engine, f"tcp://127.0.0.1:{port}", "decode-0", store=_store(url, engine))
        with serving_in_thread(node):
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            try:
                yield node, url, sock
            finally:
                sock.close()


def _stream(sock, rid: str) -> tuple[list[int], int]:
    """The request's tokens and the prompt tokens its node found cached."""
    tokens, cached = [], 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not sock.poll(200):
            continue
        for out in token_outputs(decode(sock.recv())):
            if out.request_id == rid:
                tokens += out.new_token_ids
                cached = max(cached, out.num_cached_tokens)
                if out.finished:
                    return tokens, cached
    raise AssertionError(f"{rid} did not finish")


def _generate(prompt: list[int]) -> list[int]:
    engine = _engine()
    engine.add_request("r", prompt, GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokens


def test_an_abort_during_the_store_fetch_leaves_the_prompt_cached(decode_node):
    node, url, sock = decode_node
    keys, first = _prefill_into(url)
    handover = StoreHandover(len(keys) * node.engine.config.block_size, keys)  # the full blocks
    busy = threading.Event()
    node.pullers[StoreHandover].fetcher.submit(busy.wait)  # the fetch for "a" queues behind this
    sock.send(encode(DecodeRequest("a", PROMPT, GREEDY, [first], handover)))
    wait_for(lambda: node.pull_state("a") is PullState.PULLING, timeout_s=30)
    sock.send(encode(Abort("a")))
    wait_for(lambda: node.pull_state("a") is PullState.ABANDONED, timeout_s=30)
    busy.set()
    wait_for(lambda: not node.pulls, timeout_s=30)

    engine = node.engine
    assert all(key in engine.pool.cached for key in keys), "the landed blocks were freed uncached"
    wait_for(lambda: engine.pool.num_free == len(engine.pool.blocks), timeout_s=30)  # none still held
    # The next request for the prompt, with no handover, finds it all in this node's cache and
    # decodes what an engine that computed it all decodes.
    sock.send(encode(DecodeRequest("b", PROMPT, GREEDY)))
    got, cached = _stream(sock, "b")
    assert cached == len(keys) * engine.config.block_size
    assert got == _generate(PROMPT)
    assert engine.get_request("b") is None and engine.pool.num_free == len(engine.pool.blocks)
