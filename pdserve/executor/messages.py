"""What the driver tells its workers, as msgspec structs over each worker's stdin pipe (no
pickle): the worker's start-up spec (in its argv), then one StepPlan per model step, or Shutdown.

The pipe doubles as the worker's lifeline: its end of file means the driver is gone.
"""
from __future__ import annotations

import os
import struct

import msgspec


class WorkerSpec(msgspec.Struct, frozen=True):
    """Everything a worker needs to build its shard and attach to the node's KV cache."""
    rank: int
    world_size: int
    store_host: str
    store_port: int
    model_path: str
    dtype: str               # torch dtype name, e.g. "float32"
    device: str              # "cpu" or "cuda:N"
    kernel_backend: str
    threads: int             # compute threads of this rank (torch and numba)
    kv_fd: int               # inherited descriptor of the shared KV cache file (CPU)
    kv_shape: list[int]      # [blocks, layers, planes, block_size, kv_heads, head_dim]
    payload_fd: int          # inherited descriptor of the step-input buffer (see step_channel)
    payload_capacity: int    # int64 elements
    timeout_s: float
    collectives_fd: int = -1       # inherited descriptor of the shared-memory collectives' buffer
    expert_parallel: bool = False  # MoE experts partitioned across ranks, not split inside each
    pp_size: int = 1               # pipeline stages; world_size = pp_size * the TP degree
    max_loras: int = 0             # LoRA slots per layer (0: adapters off), as the driver's
    max_lora_rank: int = 0
    kv_dtype: str = ""             # the KV cache's torch dtype name ("": the model's)
    gemm_dtype: str = "float32"    # the quantized tiles' product dtype (kernels.dequant_tiles)
    state_fd: int = -1             # a hybrid model's shared recurrent-state arena (sized by MapStates)


class StepPlan(msgspec.Struct, frozen=True, tag="step"):
    """One step's shape; its arrays travel through the step channel (shared memory or a
    broadcast), `in_shm` says which."""
    num_tokens: int
    num_decodes: int
    int32_shapes: list[list[int]]
    logit_passes: list[tuple[int, int]]   # hidden row ranges turned into logits first, in order
    sample_rows: list[int]                # then these rows' logits (all rows when all_logits)
    all_logits: bool
    in_shm: bool
    # Pipeline: the last stage sends the step's final hidden states back to the driver instead
    # of logits (embeddings).
    return_hidden: bool = False
    # Where the arrays start in the shared buffer (int64 elements): a pipeline's micro-batches of
    # one step each have their own region, since a later stage copies its inputs out late.
    payload_offset: int = 0
    # LoRA: the step's rows as (adapter slot or -1 for the base model, tokens), in row order.
    lora_rows: list[tuple[int, int]] = []
    # A vision-language model: the arrays end with [3, T] M-RoPE positions (mrope_positions),
    # then the rows that hold image placeholders (image_rows of them), whose embeddings follow
    # the arrays as a float broadcast (pdserve.executor.step_channel).
    mrope_positions: bool = False
    image_rows: int = 0
    # A hybrid model (engine.state_pool.StateRows): the decode rows' state slots, then each
    # prefill chunk's (slot, first row, end row). The driver zeroes fresh slots before sending.
    state_slots: list[int] = []
    state_spans: list[tuple[int, int, int]] = []


class LoadLoRA(msgspec.Struct, frozen=True, tag="load_lora"):
    """Read the PEFT adapter at path into LoRA slot `slot` of this rank's shard (the driver
    loaded it into the same slot of its own)."""
    slot: int
    name: str
    path: str


class StateLayer(msgspec.Struct, frozen=True):
    """One stateful layer's window and state (models.state_layers.LayerStateSpec), dtypes by name."""
    conv_shape: list[int]
    conv_dtype: str
    state_shape: list[int]
    state_dtype: str


class MapStates(msgspec.Struct, frozen=True, tag="map_states"):
    """Map the node's recurrent-state arena (WorkerSpec.state_fd, now num_slots slots of these
    layers) before the next step: a hybrid model's pool, sized once the driver's model loaded."""
    num_slots: int
    layers: list[StateLayer]


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


class ReportWaits(msgspec.Struct, frozen=True, tag="report_waits"):
    """Each worker sends rank 0 the seconds it has waited for work so far (for measuring a
    pipeline's idle stages): one float64 tensor over the node group."""


Control = StepPlan | Shutdown | ReportWaits | LoadLoRA | MapStates
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Control)
_LEN = struct.Struct("<I")


def write_message(fd: int, msg: Control) -> None:
    body = _encoder.encode(msg)
    _write_all(fd, _LEN.pack(len(body)) + body)


def read_message(fd: int) -> Control | None:
    """The next message, or None at end of file (the driver is gone)."""
    head = _read_exact(fd, _LEN.size)
    if head is None:
        return None
    body = _read_exact(fd, _LEN.unpack(head)[0])
    return None if body is None else _decoder.decode(body)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
