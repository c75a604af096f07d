"""NIXL READ bandwidth between two processes versus a single-thread memcpy.

    .venv/bin/python -m benchmarks.kv_transfer.bench_nixl [--total-mib 64] [--block-kib 256] [--runs 9]
    python -m benchmarks.kv_transfer.bench_nixl --device cuda --configs 0 --json out.json   # VRAM to VRAM

A prefill process and a decode process (both spawned, so each UCX config gets a clean
environment) hold block-major caches twice the transfer size. The decode side READs
total/block blocks per run; only msgspec bytes cross the pipes. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec
import torch

from pdserve.kvstore.nixl_transfer import NixlKVAgent, block_digest, mismatched_blocks
from pdserve.wire.handover import NixlHandover, NixlMetadata

encode_message = msgspec.msgpack.encode
decode_message = msgspec.msgpack.Decoder(NixlMetadata | NixlHandover).decode


class Config(msgspec.Struct):
    label: str
    env: dict[str, str]
    error_handling: str
    progress_thread: bool
    num_threads: int = 0


class Job(msgspec.Struct):
    config: Config
    num_blocks: int  # per side; a transfer moves num_blocks // 2
    block_elems: int  # bfloat16 elements per block
    runs: int
    device: str = "cpu"  # cuda: both caches in GPU memory, registered as VRAM


class Publish(msgspec.Struct):
    block_ids: list[int]


class Result(msgspec.Struct):
    path: str
    gbps: float
    first_ms: float = 0.0
    ok: bool = True
    memcpy_gbps: float = 0.0  # copy_ measured alongside, same process (single-thread on CPU)


CONFIGS = [
    Config("error_handling=none, no progress thread (ours)", {}, "none", False),
    Config("error_handling=peer + progress threads (NIXL default)", {}, "peer", True),
    Config("error_handling=peer, no progress threads", {}, "peer", False),
    Config("UCX_TLS=tcp, error_handling=none", {"UCX_TLS": "tcp"}, "none", False),
    # GPU memory: CUDA IPC between processes on one GPU, cuda_copy for staging.
    Config("UCX_TLS=cuda_ipc,cuda_copy,sm,tcp, error_handling=none",
           {"UCX_TLS": "cuda_ipc,cuda_copy,sm,tcp"}, "none", False),
    Config("UCX_TLS=cuda_ipc,cuda_copy,sm,tcp, UCX_RNDV_THRESH=0",
           {"UCX_TLS": "cuda_ipc,cuda_copy,sm,tcp", "UCX_RNDV_THRESH": "0"}, "none", False),
    Config("error_handling=none, UCX num_threads=2", {}, "none", False, 2),
    # GPU memory where CUDA IPC is unavailable (a VM): staged through pinned host memory.
    Config("UCX_TLS=cuda_copy,sm,self, pipelined rendezvous",
           {"UCX_TLS": "cuda_copy,sm,self", "UCX_RNDV_SCHEME": "put_ppln",
            "UCX_RNDV_FRAG_MEM_TYPE": "host"}, "none", False),
    Config("UCX_TLS=cuda_copy,sm,self, get_zcopy",
           {"UCX_TLS": "cuda_copy,sm,self", "UCX_RNDV_SCHEME": "get_zcopy"}, "none", False),
    Config("UCX_TLS=cuda_copy,tcp,self", {"UCX_TLS": "cuda_copy,tcp,self"}, "none", False),
]


def _make_cache(job: Job, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (job.num_blocks, job.block_elems)
    return torch.randint(-2**15, 2**15, shape, generator=gen, dtype=torch.int16).to(job.device)


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _agent(name: str, job: Job, seed: int) -> tuple[NixlKVAgent, float]:
    """The agent and its setup time in ms (agent, backend, registration; not the cache)."""
    c, kv = job.config, _make_cache(job, seed)
    t0 = time.perf_counter()
    agent = NixlKVAgent(name, kv, error_handling=c.error_handling,
                        progress_thread=c.progress_thread, num_threads=c.num_threads)
    return agent, (time.perf_counter() - t0) * 1e3


def prefill_main(conn: Connection, job_bytes: bytes) -> None:
    """Serve block regions on request; poll notifications (which also drives UCX progress)."""
    job = msgspec.msgpack.decode(job_bytes, type=Job)
    agent, _ = _agent("bench-prefill", job, seed=2)
    conn.send_bytes(encode_message(NixlMetadata(agent.name, agent.metadata())))
    peer = decode_message(conn.recv_bytes())
    assert isinstance(peer, NixlMetadata)
    agent.add_peer(peer.metadata)
    pub_decoder = msgspec.msgpack.Decoder(Publish)
    while True:
        if conn.poll(0.001):
            try:
                ids = pub_decoder.decode(conn.recv_bytes()).block_ids
            except EOFError:
                break
            msg = NixlHandover(0, agent.name, "", agent.block_regions(ids),
                               block_digest(agent.kv_cache, ids), lease_s=60)
            conn.send_bytes(encode_message(msg))
        agent.get_notifications()
    agent.close()


def _time_reads(agent: NixlKVAgent, peer: str, msg: NixlHandover, local: list[int],
                runs: int, per_block: bool) -> tuple[float, float, float]:
    """(first-run s, median READ s, median memcpy s). A single-thread copy_ of the same bytes
    runs before each READ in this process, so both see the same (shared, noisy) machine."""
    src = torch.empty(len(local), agent.block_nbytes, dtype=torch.uint8,
                      device=agent.kv_cache.device).fill_(1)
    dst = torch.empty_like(src)

    def read() -> float:
        t0 = time.perf_counter()
        if per_block:  # one xfer per block, all posted before waiting
            hs = [agent.start_read(peer, [r], [b]) for r, b in zip(msg.regions, local)]
            for h in hs:
                agent.wait(h)
        else:
            agent.wait(agent.start_read(peer, msg.regions, local))
        return time.perf_counter() - t0

    def copy() -> float:
        _sync(dst)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dst)
        return time.perf_counter() - t0
    first = read()
    read(), copy()  # warm-up
    pairs = [(copy(), read()) for _ in range(runs)]
    return (first, statistics.median(r for _, r in pairs),
            statistics.median(c for c, _ in pairs))


def decode_main(conn: Connection, out: Connection, job_bytes: bytes) -> None:
    job = msgspec.msgpack.decode(job_bytes, type=Job)
    torch.set_num_threads(1)  # the memcpy reference is single-threaded
    agent, setup_ms = _agent("bench-decode", job, seed=3)
    info = decode_message(conn.recv_bytes())
    assert isinstance(info, NixlMetadata)
    peer = agent.add_peer(info.metadata)
    conn.send_bytes(encode_message(NixlMetadata(agent.name, agent.metadata())))
    agent.make_connection(peer)
    n = job.num_blocks // 2
    rng = random.Random(0)
    paths = [("random blocks, one xfer", rng.sample(range(job.num_blocks), n),
              rng.sample(range(job.num_blocks), n), False),
             ("random blocks, one xfer per block", rng.sample(range(job.num_blocks), n),
              rng.sample(range(job.num_blocks), n), True),
             ("contiguous blocks, coalesced to 1 desc", list(range(n)), list(range(n, 2 * n)),
              False)]
    results = [Result("agent setup", 0.0, setup_ms)]
    for label, remote, local, per_block in paths:
        conn.send_bytes(msgspec.msgpack.encode(Publish(remote)))
        msg = decode_message(conn.recv_bytes())
        assert isinstance(msg, NixlHandover)
        first, med, copy = _time_reads(agent, peer, msg, local, job.runs, per_block)
        ok = not mismatched_blocks(agent.kv_cache, local, msg.digests)
        nbytes = n * agent.block_nbytes
        results.append(Result(label, nbytes / med / 1e9, first * 1e3, ok, nbytes / copy / 1e9))
    out.send_bytes(msgspec.msgpack.encode(results))
    agent.close()


def run_config(job: Job) -> list[Result]:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    res_r, res_w = ctx.Pipe(duplex=False)
    saved = dict(os.environ)
    os.environ.update(job.config.env)  # spawned children inherit the environment
    try:
        job_bytes = msgspec.msgpack.encode(job)
        procs = [ctx.Process(target=prefill_main, args=(a, job_bytes)),
                 ctx.Process(target=decode_main, args=(b, res_w, job_bytes))]
        for p in procs:
            p.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        if not res_r.poll(300):
            raise TimeoutError(f"{job.config.label}: no result")
        return msgspec.msgpack.decode(res_r.recv_bytes(), type=list[Result])
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _median_gbps(fn: Callable[[], None], nbytes: int, runs: int, like: torch.Tensor) -> float:
    fn()
    times = []
    for _ in range(runs):
        _sync(like)
        t0 = time.perf_counter()
        fn()
        _sync(like)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def memcpy_baselines(job: Job) -> list[Result]:
    """Single-thread torch copies of the same bytes in one process."""
    torch.set_num_threads(1)
    n = job.num_blocks // 2
    src = _make_cache(job, 1)
    dst = torch.empty(job.num_blocks, job.block_elems, dtype=torch.int16, device=src.device)
    nbytes = n * job.block_elems * 2
    rng = random.Random(0)
    ridx = torch.tensor(rng.sample(range(job.num_blocks), n), device=src.device)
    lidx = torch.tensor(rng.sample(range(job.num_blocks), n), device=src.device)
    contiguous = _median_gbps(lambda: dst[n:].copy_(src[:n]), nbytes, job.runs, src)
    gathered = _median_gbps(lambda: dst.index_copy_(0, lidx, src.index_select(0, ridx)),
                            nbytes, job.runs, src)
    per_block = _median_gbps(lambda: [dst[int(lb)].copy_(src[int(rb)])
                                      for lb, rb in zip(lidx.tolist(), ridx.tolist())],
                             nbytes, job.runs, src)
    return [Result("torch copy_, contiguous", contiguous),
            Result("torch index_select+index_copy_, random blocks", gathered),
            Result("torch copy_ per block, random blocks", per_block)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total-mib", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--configs", default="0,1,2,3", help="indices into CONFIGS")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", default=None, help="also write every row here")
    args = ap.parse_args()
    block_elems = args.block_kib * 1024 // 2
    num_blocks = 2 * args.total_mib * 1024 // args.block_kib
    base = Job(CONFIGS[0], num_blocks, block_elems, args.runs, args.device)
    rows: list[dict] = []
    mem = memcpy_baselines(base)
    ref = mem[0].gbps
    print(f"{args.total_mib} MiB per READ in {args.block_kib} KiB blocks, median of "
          f"{args.runs} after warm-up, {os.cpu_count()} CPUs. torch rows: % of the contiguous "
          "copy_ above; NIXL rows: % of a copy_ of the same bytes interleaved with the READs in "
          "the decode process (the machine is shared, so only same-moment ratios compare)\n")
    print("| path | GB/s | % of memcpy | memcpy alongside (GB/s) | first READ (ms) | bit-exact |")
    print("|---|---:|---:|---:|---:|---|")
    for r in mem:
        rows.append({"path": r.path, "gbps": r.gbps})
        print(f"| {r.path} | {r.gbps:.2f} | {100 * r.gbps / ref:.0f}% | | | |")
    for i in map(int, args.configs.split(",")):
        for r in run_config(Job(CONFIGS[i], num_blocks, block_elems, args.runs, args.device)):
            name = f"NIXL {CONFIGS[i].label}: {r.path}"
            rows.append({"path": name, **msgspec.structs.asdict(r)})
            if r.path.startswith("agent setup"):
                print(f"| {name} | | | | {r.first_ms:.0f} | |")
                continue
            print(f"| {name} | {r.gbps:.2f} | {100 * r.gbps / r.memcpy_gbps:.0f}% | "
                  f"{r.memcpy_gbps:.2f} | {r.first_ms:.1f} | {'yes' if r.ok else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "total_mib": args.total_mib,
                       "block_kib": args.block_kib, "rows": rows}, f, indent=1)

if __name__ == "__main__":
    main()
