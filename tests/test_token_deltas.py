"""A node sends a step's outputs for one router in one message (TokenDeltas), and each request's
tokens are those of the engine alone.

A real decode node (engine, zmq ROUTER socket) serves on loopback in a thread; a DEALER plays the
router and sends three requests at once. The cluster tests cover the router's side of the same
messages (every streamed token there comes through them).
"""
from __future__ import annotations

import time

import zmq
from node_thread import serving_in_thread

from pdserve import LLM
from pdserve.assembly.build import build_engine
from pdserve.engine.config import EngineConfig
from pdserve.node.decode import DecodeNode
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.wire.messages import DecodeRequest, TokenDelta, TokenDeltas, decode, encode, token_outputs
from pdserve.wire.transport import free_port

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = {f"r{i}": [(i * 31 + j * 7) % 250 + 3 for j in range(20 + 9 * i)] for i in range(3)}


def _streamed(sock) -> tuple[dict[str, list[int]], list[int]]:
    """Each request's tokens, and how many outputs each message carried."""
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    sizes, done, deadline = [], set(), time.monotonic() + 60
    while len(done) < len(PROMPTS) and time.monotonic() < deadline:
        if not sock.poll(200):
            continue
        msg = decode(sock.recv())
        assert isinstance(msg, (TokenDelta, TokenDeltas))
        sizes.append(len(token_outputs(msg)))
        for out in token_outputs(msg):
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                done.add(out.request_id)
    assert done == set(PROMPTS)
    return tokens, sizes


def test_a_steps_outputs_for_one_router_come_in_one_message():
    engine = build_engine(EngineConfig(model="builtin:tiny", num_kv_blocks=64))
    port = free_port()
    with serving_in_thread(DecodeNode(engine, f"tcp://127.0.0.1:{port}", "decode-0")):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        try:
            for rid, prompt in PROMPTS.items():
                sock.send(encode(DecodeRequest(rid, prompt, GREEDY)))
            tokens, sizes = _streamed(sock)
        finally:
            sock.close()
    assert max(sizes) == len(PROMPTS)  # the steps that decode all three: one message each
    reference = LLM("builtin:tiny", num_kv_blocks=64).generate(
        [{"prompt_token_ids": p} for p in PROMPTS.values()], GREEDY, use_tqdm=False)
    assert [tokens[rid] for rid in PROMPTS] == [r.outputs[0].token_ids for r in reference]
