"""NIXL READs between two processes in two network namespaces of this machine (the Ray lab's
"machines", tests/ray_util.py), or on loopback: each READ's state and time, and UCX's logs of
both peers (which lanes UCX built for the other process), to compare the two
(docs/testing.md, "The NIXL READ stall across network namespaces").

    scripts/nixl-netns-read.py lab|local OUT_DIR [UCX_TLS|default]

Needs root (the namespaces). READS (default 20) READs of 8 blocks each; the target progresses
its worker every PROGRESS_S seconds (default 0.005; a prefill node between steps), so a READ
that needs the target's progress takes about that long.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the lab's namespaces


def _env(tls: str) -> dict:
    env = dict(os.environ, UCX_LOG_LEVEL=os.environ.get("UCX_LOG_LEVEL", "info"))
    if tls != "default":
        env["UCX_TLS"] = tls
    return env


def run_peers(where: str, out: Path, tls: str) -> None:
    """The target, then the reader, each in its namespace (lab) or here (local); waits for the reader."""
    me = [sys.executable, __file__]
    if where == "local":
        with open(out / "target.log", "w") as tl, open(out / "reader.log", "w") as rl:
            target = subprocess.Popen([*me, "target", str(out), "127.0.0.1"], stdout=tl, stderr=subprocess.STDOUT,
                                      env=_env(tls))
            reader = subprocess.Popen([*me, "reader", str(out), "127.0.0.1"], stdout=rl, stderr=subprocess.STDOUT,
                                      env=_env(tls))
            reader.wait(timeout=600)
            target.terminate()
            target.wait(timeout=30)
        return
    from ray_util import Lab
    lab = Lab({"pa": 2, "pb": 3})
    lab.up()
    try:
        target = lab.popen("pb", [*me, "target", str(out), lab.addr("pb")], str(out / "target.log"), _env(tls))
        reader = lab.popen("pa", [*me, "reader", str(out), lab.addr("pa")], str(out / "reader.log"), _env(tls))
        reader.wait(timeout=600)
        target.terminate()
        target.wait(timeout=30)
    finally:
        lab.stop_all()
        lab.down()


def peer(role: str, out: Path, host: str) -> None:
    import torch

    from pdserve.kvstore.ucx_devices import pin_ucx_to_host
    pin_ucx_to_host(host)  # as a node does: UCX on the device holding its address
    from pdserve.kvstore.nixl_transfer import NixlKVAgent
    blocks = 64
    cache = torch.arange(blocks * 4096, dtype=torch.float32).reshape(blocks, 4096)
    if role == "reader":
        cache.zero_()
    agent = NixlKVAgent(role, cache)
    if role == "target":
        (out / "target.meta").write_bytes(agent.metadata())
        (out / "target.regions").write_text(json.dumps(agent.block_regions(range(blocks))))
        while True:  # killed by the driver
            agent.get_notifications()
            time.sleep(float(os.environ.get("PROGRESS_S", "0.005")))
    while not (out / "target.regions").exists():
        time.sleep(0.1)
    time.sleep(0.5)  # the regions file is written last
    name = agent.add_peer((out / "target.meta").read_bytes())
    agent.make_connection(name)
    regions = json.loads((out / "target.regions").read_text())
    stalls = 0
    for i in range(int(os.environ.get("READS", "20"))):
        ids = [(i * 7 + k) % blocks for k in range(8)]
        cache[ids] = 0
        started = time.monotonic()
        handle = agent.start_read(name, [regions[b] for b in ids], ids, notif=f"r{i}".encode(), timeout_s=5.0)
        while (state := agent.poll(handle)) == "PROC":
            time.sleep(0.0005)
        whole = all(torch.equal(cache[b], torch.arange(b * 4096, (b + 1) * 4096, dtype=torch.float32)) for b in ids)
        stalls += state != "DONE"
        print(f"read {i}: {state} bytes whole={whole} {time.monotonic() - started:.3f} s", flush=True)
    print(f"stalled: {stalls}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] in ("lab", "local"):
        run_peers(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "default")
    else:
        peer(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
