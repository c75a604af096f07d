"""A tensor-parallel worker process (ranks 1..N-1): `python -m pdserve.executor.worker SPEC`.

It joins the driver's TP group, builds its shard of the model, maps the node's shared KV cache
and step buffer, then runs one step per StepPlan read from its stdin until Shutdown or end of
file. It dies with its driver: PR_SET_PDEATHSIG (set before exec) kills it when the driver
goes, the pipe's end of file ends it between steps, and a collective whose peer is gone fails.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import msgspec

from pdserve.executor.messages import Shutdown, WorkerSpec, read_message

log = logging.getLogger("pdserve.executor.worker")


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; it ends us
    spec = msgspec.json.decode(argv[1].encode(), type=WorkerSpec)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{spec.rank} %(levelname)s %(message)s")
    shard = _Shard(spec)
    log.info("rank %d of %d ready", spec.rank, spec.world_size)
    while True:
        msg = read_message(sys.stdin.fileno())
        if msg is None or isinstance(msg, Shutdown):
            return 0
        shard.step(msg)


class _Shard:
    def __init__(self, spec: WorkerSpec):
        # Deferred on purpose: torch and the model code load here, after main has set SIGINT
        # aside (loading takes seconds, and a Ctrl-C meanwhile is the driver's to handle).
        import torch

        from pdserve.executor.group import join_store, make_group, set_rank_threads
        from pdserve.executor.kv_shared import fd_path, kv_head_range, map_shared, rank_layer_caches
        from pdserve.executor.setup import load_shard
        from pdserve.executor.shard_step import run_worker_step
        from pdserve.executor.shm_collectives import ShmCollectives
        from pdserve.executor.step_channel import StepChannel
        from pdserve.kernels import get_fused_layer_ops, get_ops
        from pdserve.models.loader import load_hf_config

        set_rank_threads(spec.threads)
        self.device = torch.device(spec.device)
        store = join_store(spec.store_host, spec.store_port, spec.world_size, spec.timeout_s)
        store.set(f"joined/{spec.rank}", "1")
        shm = ShmCollectives(spec.collectives_fd, spec.rank, spec.world_size, _driver_check(), spec.timeout_s)
        group = make_group(store, spec.rank, spec.world_size, self.device, spec.timeout_s, shm)
        self.channel = StepChannel(fd_path(spec.payload_fd), spec.payload_capacity, group)
        dtype = getattr(torch, spec.dtype)
        hf_config = load_hf_config(Path(spec.model_path))
        self.model = load_shard(spec.model_path, hf_config, dtype, self.device, group, spec.expert_parallel)
        kv_cache = map_shared(fd_path(spec.kv_fd), spec.kv_shape, dtype)
        heads = kv_head_range(spec.kv_shape[4], spec.world_size, spec.rank)
        self.layer_caches = rank_layer_caches(kv_cache, heads)
        self.ops = get_ops(spec.kernel_backend, self.device.type)
        if hasattr(self.ops, "warm_up"):
            self.ops.warm_up()
        self.model.fused = get_fused_layer_ops(self.ops, self.device.type)
        self._run_step = run_worker_step
        store.set(f"ready/{spec.rank}", "1")

    def step(self, plan) -> None:
        flat = self.channel.receive(plan)
        self._run_step(self.model, self.ops, self.layer_caches, self.device, plan, flat)


def _driver_check():
    """Raises once the driver (this process's parent) is gone."""
    driver = os.getppid()

    def check() -> None:
        if os.getppid() != driver:
            raise RuntimeError("the driver is gone")
    return check


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except Exception:  # a lost peer fails a collective: say so, exit non-zero (the driver sees it)
        log.exception("tensor-parallel worker failed")
        os._exit(1)
