"""Bandwidth of the copies a host-staged KV handover makes on one GPU: device to pinned host,
pinned host to device, and device to device for scale (bytes moved per second, one direction).

    python3 -m benchmarks.gpu.gpu_staging_bandwidth [--mib 256] [--runs 10]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch


def timed_copy(dst: torch.Tensor, src: torch.Tensor, runs: int) -> float:
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return src.numel() * src.element_size() / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    n = args.mib << 20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    result = {"mib": args.mib,
              "device_to_host_gbps": timed_copy(host, dev, args.runs) / 1e9,
              "host_to_device_gbps": timed_copy(dev, host, args.runs) / 1e9,
              "device_to_device_gbps": timed_copy(dev2, dev, args.runs) / 1e9}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
