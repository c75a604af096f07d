"""A NIXL handover whose landed bytes do not match the prefill node's digests is caught on the
decode node, counted in /metrics, and the prompt is recomputed there: the client's output is
still the offline engine's. The corruption is a real flipped byte in the landed block (the
decode node's fault hook flips it after the READ, before the check), over real NIXL agents in
separate processes."""
from __future__ import annotations

import httpx
import pytest

from pdserve import LLM
from pdserve.kvstore.nixl_transfer import nixl_import_error
from pdserve.node.pullers import CORRUPT_PULLS_ENV
from pdserve.testing.up_cluster import assert_greedy_matches_offline, node_stats, running_cluster, wait_for

pytestmark = pytest.mark.skipif(nixl_import_error() is not None, reason=f"NIXL: {nixl_import_error()}")


def _digest_failures(url: str, node: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("pdserve_kv_transfer_failures") and 'reason="digest_mismatch"' in line
               and f'node="{node}"' in line)


def test_flipped_byte_in_a_nixl_handover_is_caught_counted_and_recomputed(monkeypatch):
    monkeypatch.setenv(CORRUPT_PULLS_ENV, "2")  # the first two pulls land corrupt, then clean ones
    llm = LLM("builtin:tiny", num_kv_blocks=256)
    prompts = [[(13 * i + k) % 200 + 20 for i in range(120)] for k in range(3)]
    with running_cluster("--kv-transfer", "nixl", "--prefill-nodes", "1", "--decode-nodes", "1",
                         "--num-kv-blocks", "256") as (url, _proc):
        for prompt in prompts:
            assert_greedy_matches_offline(url, llm, prompt, 8)
        wait_for(lambda: node_stats(url)["decode-0"].get("integrity_failures", 0) == 2, timeout_s=10)
        assert _digest_failures(url, "decode-0") == 2
        # The third handover landed clean and was used: corruption is per transfer, not sticky.
        wait_for(lambda: node_stats(url)["decode-0"].get("transfers_ok", 0) >= 1, timeout_s=10)
