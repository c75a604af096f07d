"""Typed control-plane messages between router and nodes, encoded with msgspec msgpack.

Every message is a tagged Struct, so a decoder accepts exactly the types listed in Message and
nothing else travels on a socket: no pickle anywhere.
"""
from __future__ import annotations

import msgspec

from pdserve.protocol.multimodal import ImageInput
from pdserve.protocol.outputs import StepOutput, TokenLogprob
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.wire.compat import KVCompat
from pdserve.wire.embedding_handover import EmbeddingHandover
from pdserve.wire.handover import KVHandover, NixlMetadata, NixlMetadataRequest, Region, Transport

# Bump when routers and nodes can no longer read each other's messages: a router keeps a node whose
# pongs say another version out of its rotation, with one clear error, instead of mis-serving it.
WIRE_VERSION = 4  # 2: PrefillRequest and DecodeRequest carry the prompt's images; 3: TokenDeltas; 4: PrefixLoaded


class Ping(msgspec.Struct, tag=True):
    seq: int


# The roles a node serves: Pong.role, registry records, Drain.to_role, StartNode/SetNodeRole.role.
ROLES = ("prefill", "decode")


class Pong(msgspec.Struct, tag=True):
    seq: int
    node_id: str
    role: str
    num_requests: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    stats: dict[str, int] = {}
    kv_salt: bytes = b""   # the node's block-key salt (model, KV layout, dtype, block size)
    # "active"; "draining" (told to drain, work still in flight); "drained" (idle, waiting to be
    # stopped). A node switching roles turns "active" again under its new role.
    state: str = "active"
    loras: list[str] = []         # LoRA adapters registered on the node (pdserve.lora)
    active_loras: list[str] = []  # ... and those resident in its slots now (no load to serve them)
    lora_enabled: bool = False    # the node's engine serves adapters at all (--enable-lora)
    version: int = WIRE_VERSION   # the messages the node speaks
    # What the node's KV is (weights digest, dtypes, layout, shape): the router pairs only nodes
    # whose KV agrees (pdserve.wire.compat); None from a node that does not say.
    compat: KVCompat | None = None


class KVEvents(msgspec.Struct, tag=True):
    """Block keys a node's prefix cache gained and lost since its previous batch.

    seq counts batches from 1 within one epoch (a node process's lifetime); a router that sees a
    new epoch or a skipped seq asks for a snapshot. A snapshot lists every key held, at that seq.
    """
    node_id: str
    epoch: int
    seq: int
    stored: list[bytes] = []
    removed: list[bytes] = []
    snapshot: bool = False


class KVSnapshotRequest(msgspec.Struct, tag=True):
    pass


class PrefillRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    transfer: Transport
    # The request's salt string (engine/cache_salt.py: cache_salt and/or tenant) and LoRA adapter
    # name: both enter its block keys' salt (block_keys.request_salt) on every node.
    cache_salt: str | None = None
    adapter: str | None = None
    # A vision-language prompt's images (placeholders already expanded in prompt_token_ids):
    # their keys enter the block keys, and the node encodes them.
    images: list[ImageInput] = []
    # E/P/D over NIXL: images an encoder node encoded, read from its arena instead of encoded here.
    embeddings: list[EmbeddingHandover] = []
    # Leading prompt tokens the decode node that will take the handover holds already (the
    # router's prefix index: an earlier turn of the conversation): the node hands over only the
    # blocks after them. 0: every block (an older router).
    decode_holds_tokens: int = 0
    # Push mode: its decode node waits already, so a store handover's first token goes out
    # before the put (PrefillResult.handover_follows), and the handover after it (HandoverMade);
    # so does a NIXL one's when the decode node's WriteTarget has not come by the first token.
    push: bool = False
    # Pull mode through the store: the same, the router sending the decode node the request once
    # the HandoverMade comes; the put no longer holds the first token (an older node ignores it
    # and answers with the handover, which the router takes as before).
    put_after_token: bool = False
    # Push mode over NIXL: the decode node was asked to lend its blocks after this node's
    # (DecodeRequest.lend_from_tokens): the prompt awaits them (node.borrowed_prefix).
    decode_lends: bool = False


class PrefillResult(msgspec.Struct, tag=True):
    request_id: str
    first: StepOutput | None = None  # the first token, as the client will see it
    handover: KVHandover | None = None
    error: str | None = None
    handover_follows: bool = False  # the handover comes in a HandoverMade (PrefillRequest.push, .put_after_token)


class HandoverMade(msgspec.Struct, tag=True):
    """Prefill node -> router: a handover made after its first token went out (push mode, or a
    store put in pull mode; None: it failed, the decode node computes the prompt)."""
    request_id: str
    handover: KVHandover | None = None


class PrefixLoaded(msgspec.Struct, tag=True):
    """Prefill node -> router -> the decode node a push-mode request waits on: the prefill node's
    load of the prompt's stored prefix is over (or it had none to load), so the decode node's own
    load of that prefix (--prefetch-stored-prefix) no longer competes with it for the store."""
    request_id: str


class DecodeRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token_ids: list[int] = []  # drawn by the prefill node
    handover: KVHandover | None = None
    # The stream's inter-token latency target, seconds (0: none): the decode node caps the prompt
    # tokens its steps prefill so that its streams keep their targets (pdserve.protocol.tpot_budget).
    itl_slo_s: float = 0.0
    cache_salt: str | None = None  # as PrefillRequest's
    adapter: str | None = None
    # As PrefillRequest's: a decode node needs them for the block keys and M-RoPE positions,
    # and to compute the prompt itself if its KV never lands.
    images: list[ImageInput] = []
    # Push mode: sent beside the PrefillRequest, before any token is drawn. The node allocates
    # the prompt's blocks and waits in WAITING_FOR_REMOTE_KVS for a KVReady with the first
    # token and the handover (handover and first_token_ids are empty here).
    push: bool = False
    # Push mode over NIXL: the leading prompt tokens the prefill node holds (the router's prefix
    # index), where this node is believed to hold more (an earlier turn's answer): its WriteTarget
    # lends the blocks it holds after them (WriteTarget.held), which the prefill node READs
    # instead of computing. -1: lend none.
    lend_from_tokens: int = -1

    def pulls_kv(self) -> bool:
        """The receiver pulls the prompt's KV (store fetch or NIXL READ), rather than computing it."""
        return self.handover is not None and self.handover.num_tokens > 0


class KVReady(msgspec.Struct, tag=True):
    """Router -> the decode node a push-mode DecodeRequest went to: the prefill node's first
    token and handover. No first token: no prefill node could compute the prompt, so the decode
    node does (as it does with no handover)."""
    request_id: str
    first_token_ids: list[int] = []
    handover: KVHandover | None = None


class WriteTarget(msgspec.Struct, tag=True):
    """Decode node -> router -> the prefill node computing a push-mode request over NIXL: where to
    WRITE the prompt's blocks as its chunks complete (the blocks the request waits with). The
    prefill node writes no block after lease_s from receiving it; the decode node frees the blocks
    of a request aborted meanwhile only once the writer says it is done, or after the lease."""
    request_id: str
    peer: NixlMetadata  # the decode node's agent, checked as a READ's handshake is
    first_block: int    # the first prompt block the decode node lacks; regions start at it
    regions: list[Region]
    lease_s: float
    # Blocks [held_from, first_block) of the prompt, which the decode node holds (its prefix
    # cache) and lends for a READ under the same lease (DecodeRequest.lend_from_tokens), with
    # their xxh3-64 digests; none: nothing lent.
    held_from: int = 0
    held: list[Region] = []
    held_digests: list[int] = []


class EncodeRequest(msgspec.Struct, tag=True):
    """Encode these images and hand their embeddings over (an encoder node's one job:
    pdserve.node.encode): in the store under their hashes, or pinned for a NIXL READ; the prefill
    node then takes them instead of encoding."""
    request_id: str
    images: list[ImageInput]


class EncodeResult(msgspec.Struct, tag=True):
    request_id: str
    stored: list[str] = []  # the content hashes now in the store
    error: str | None = None
    handovers: list[EmbeddingHandover] = []  # over NIXL: where each image's embeddings wait


class EmbedRequest(msgspec.Struct, tag=True):
    """Pool the final hidden states of each prompt (any node role computes them)."""
    request_id: str
    prompts: list[list[int]]
    pooling: str = "last"  # "last" | "mean" (pdserve.engine.embedding.POOLINGS)


class EmbedResult(msgspec.Struct, tag=True):
    request_id: str
    vectors: list[bytes] = []  # per prompt: L2-normalised little-endian float32
    num_tokens: int = 0        # every prompt's tokens, for usage
    error: str | None = None


class LoadLoRA(msgspec.Struct, tag=True):
    """Router -> node: register a PEFT adapter directory under lora_name (vLLM's
    /v1/load_lora_adapter body). Answered with a LoRAReply carrying seq."""
    lora_name: str
    lora_path: str
    seq: int = 0


class UnloadLoRA(msgspec.Struct, tag=True):
    """Router -> node: unregister an adapter (requests already naming it finish)."""
    lora_name: str
    seq: int = 0


class LoRAReply(msgspec.Struct, tag=True):
    seq: int
    ok: bool
    detail: str = ""


class TokenDelta(msgspec.Struct, tag=True):
    output: StepOutput


class TokenDeltas(msgspec.Struct, tag=True):
    """A step's outputs for one router, in one message: at 128 streams a TokenDelta each had cost
    the node 128 sends a step and the router 128 receives (about 15 us a token of its CPU there)."""
    outputs: list[StepOutput]


def token_outputs(msg: Message) -> list[StepOutput]:
    """The outputs a TokenDelta or TokenDeltas carries; none for any other message."""
    if isinstance(msg, TokenDelta):
        return [msg.output]
    return msg.outputs if isinstance(msg, TokenDeltas) else []


class Abort(msgspec.Struct, tag=True):
    request_id: str


class Drain(msgspec.Struct, tag=True):
    """Routers send the node no new work from now on; it finishes what it holds. Once idle it
    either waits to be stopped (to_role "") or, keeping its weights and KV cache, turns into a
    `to_role` node in place. cancel=True makes a draining node active again."""
    to_role: str = ""
    cancel: bool = False


class Rejected(msgspec.Struct, tag=True):
    """The node will not serve this request (it changed role before it arrived): the router
    moves it to another node, as if the node had been lost."""
    request_id: str
    reason: str


class StartNode(msgspec.Struct, tag=True):
    """Router -> node owner: start one more node of this role."""
    role: str


class StopNode(msgspec.Struct, tag=True):
    """Router -> node owner: stop this (drained) node."""
    node_id: str


class ListNodes(msgspec.Struct, tag=True):
    pass


class SetNodeRole(msgspec.Struct, tag=True):
    """Router -> node owner: this node switched roles in place; should its process die, start
    it again in `role`, not in the role it was started with."""
    node_id: str
    role: str


class OwnerReply(msgspec.Struct, tag=True):
    ok: bool
    detail: str = ""
    node_id: str = ""
    address: str = ""                # a started node's control endpoint
    nodes: dict[str, str] = {}       # node id -> role, every node the owner runs


Message = (Ping | Pong | PrefillRequest | PrefillResult | HandoverMade | PrefixLoaded | DecodeRequest | KVReady
           | WriteTarget
           | TokenDelta | TokenDeltas | Abort
           | EncodeRequest | EncodeResult | EmbedRequest | EmbedResult | LoadLoRA | UnloadLoRA | LoRAReply
           | NixlMetadataRequest | NixlMetadata | KVEvents | KVSnapshotRequest | Drain | Rejected
           | StartNode | StopNode | ListNodes | SetNodeRole | OwnerReply)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)


__all__ = ["KVEvents", "KVSnapshotRequest", "Ping", "Pong", "PrefillRequest", "PrefillResult",
           "HandoverMade", "PrefixLoaded", "DecodeRequest", "KVReady", "WriteTarget", "EncodeRequest", "EncodeResult", "EmbedRequest", "EmbedResult", "LoadLoRA", "UnloadLoRA", "LoRAReply", "TokenDelta", "TokenDeltas", "token_outputs", "Abort", "Drain", "Rejected", "StartNode", "StopNode", "ListNodes", "SetNodeRole", "ROLES",
           "OwnerReply", "NixlMetadataRequest", "NixlMetadata", "Message", "encode", "decode", "WIRE_VERSION", "StepOutput",
           "TokenLogprob"]
