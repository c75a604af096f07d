"""A worker's shard: its part of the model (its TP slice of its pipeline stage's layers), the
node's shared KV cache and step buffer mapped in, and one step run per StepPlan
(pdserve.executor.worker drives it).

Kept apart from the worker's entry point, which imports this module only after it has set
SIGINT aside: torch and the model code load here and take seconds, and a Ctrl-C meanwhile is
the driver's to handle.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from pdserve.engine.state_pool import StatePool, StateRows, slot_nbytes
from pdserve.executor.group import join_store, make_rank_groups, set_rank_threads
from pdserve.executor.kv_shared import fd_path, kv_head_range, layer_specs, map_shared, rank_layer_caches
from pdserve.executor.messages import MapStates, WorkerSpec
from pdserve.executor.setup import load_shard
from pdserve.executor.shard_step import run_worker_step, step_images
from pdserve.executor.shm_collectives import ShmCollectives
from pdserve.executor.stage_link import StageLink, StageRole, send_waits
from pdserve.executor.step_channel import StepChannel
from pdserve.kernels import get_fused_layer_ops, get_ops, native_decode
from pdserve.kernels.dequant_tiles import set_tile_dtype
from pdserve.kernels.fp8_kv import narrow_kv_ops
from pdserve.kernels.host_memory import keep_large_allocations
from pdserve.lora.manager import fill_slot
from pdserve.lora.peft_format import read_peft_adapter
from pdserve.lora.slots import LoRABatch, attach_slots
from pdserve.models.loader import load_hf_config


class Shard:
    """One rank's part of the model and of the node's KV cache, joined to the driver's TP group."""

    def __init__(self, spec: WorkerSpec):
        set_rank_threads(spec.threads)
        self.device = torch.device(spec.device)
        store = join_store(spec.store_host, spec.store_port, spec.world_size, spec.timeout_s)
        store.set(f"joined/{spec.rank}", "1")
        role = StageRole(spec.rank, spec.world_size // spec.pp_size, spec.pp_size)
        shm = (ShmCollectives(spec.collectives_fd, role.tp_rank, role.tp_size, driver_check(), spec.timeout_s)
               if spec.collectives_fd >= 0 else None)
        groups = make_rank_groups(store, spec.rank, role.tp_size, role.pp_size, self.device, spec.timeout_s, shm)
        self.channel = StepChannel(fd_path(spec.payload_fd), spec.payload_capacity, groups.world)
        dtype = getattr(torch, spec.dtype)
        hf_config = load_hf_config(Path(spec.model_path))
        self.model = load_shard(spec.model_path, hf_config, dtype, self.device, groups.tp, spec.expert_parallel,
                                stage=role.stage, num_stages=role.pp_size)
        self.link = (StageLink(groups.world.group, role, self.model.spec.hidden_size, dtype)
                     if role.pp_size > 1 else None)
        kv_dtype = getattr(torch, spec.kv_dtype) if spec.kv_dtype else dtype
        kv_cache = map_shared(fd_path(spec.kv_fd), spec.kv_shape, kv_dtype)
        heads = kv_head_range(spec.kv_shape[4], role.tp_size, role.tp_rank)
        self.layer_caches = rank_layer_caches(kv_cache, heads)
        set_tile_dtype(getattr(torch, spec.gemm_dtype))  # as the driver's (the engine's cpu_gemm_dtype)
        if self.device.type == "cpu":
            keep_large_allocations()
        self.ops = get_ops(spec.kernel_backend, self.device.type)
        if hasattr(self.ops, "warm_up"):
            self.ops.warm_up()
        # an FP8 cache: the driver's scales, from the same checkpoint files
        self.ops = narrow_kv_ops(self.ops, kv_cache, dtype, Path(spec.model_path), spec.kv_shape[1],
                                 [k for k, *_ in self.layer_caches])
        self.model.fused = get_fused_layer_ops(self.ops, self.device.type)
        self._run_step = run_worker_step
        self.lora = None  # LoRA slots like the driver's, when adapters are on
        if spec.max_loras:
            self.lora = LoRABatch(self.device)
            self.lora_layers = attach_slots(self.model, spec.max_loras, spec.max_lora_rank, self.lora, dtype,
                                            self.device)
        if hasattr(self.model, "native_decode_weights"):  # the compiled decode step, as the driver plans it
            self.model.native_decode = native_decode.plan_for(self.model, self.layer_caches, self.device, self.lora)
        self.state_fd, self.states = spec.state_fd, None  # a hybrid model's pool, once MapStates maps it
        store.set(f"ready/{spec.rank}", "1")

    def map_states(self, msg: MapStates) -> None:
        """The driver sized the node's recurrent-state arena: map it (every head's window and
        state; this rank's layers use their heads' part)."""
        layers = layer_specs(msg.layers)
        arena = map_shared(fd_path(self.state_fd), [msg.num_slots, slot_nbytes(layers)], torch.uint8)
        self.states = StatePool(layers, msg.num_slots, self.device, arena=arena)

    def report_waits(self, pipe_seconds: float) -> None:
        """Rank 0 asked (ReportWaits): the seconds this rank waited for work, on its pipe and
        for the hidden states of the stage before."""
        link_seconds = self.link.wait_seconds if self.link is not None else 0.0
        send_waits(self.channel.group.group, pipe_seconds + link_seconds)

    def load_lora(self, msg) -> None:
        """The driver loaded an adapter into a slot: load this rank's slice of it there too."""
        fill_slot(self.lora_layers, msg.slot, read_peft_adapter(msg.name, msg.path))

    def step(self, plan) -> None:
        flat = self.channel.receive(plan)
        if self.lora is not None:
            self.lora.set_runs([(None if slot < 0 else slot, n) for slot, n in plan.lora_rows])
        values = None
        if plan.image_rows:  # a vision-language model's embeddings, after the arrays
            values = self.channel.receive_embeddings(plan.image_rows, self.model.spec.hidden_size, torch.float32)
        states = None
        if self.states is not None:
            states = StateRows(self.states, torch.tensor(plan.state_slots, dtype=torch.int64), len(plan.state_slots),
                               [tuple(span) for span in plan.state_spans])
        self._run_step(self.model, self.ops, self.layer_caches, self.device, plan, flat, self.link,
                       step_images(flat, plan, values), states)


def driver_check():
    """Raises once the driver (this process's parent) is gone."""
    driver = os.getppid()

    def check() -> None:
        if os.getppid() != driver:
            raise RuntimeError("the driver is gone")
    return check
