"""Redis dies and comes back under a 1P1D store cluster: no request fails while it is down (the
prompt is recomputed, output unchanged), and once `pdserve up` has restarted it, new prompts'
blocks are written to it again."""
from __future__ import annotations

import os
import signal

import openai
import redis

from cluster_util import node_pids, node_stats, running_cluster, wait_for
from pdserve import LLM, SamplingParams


def test_requests_survive_redis_death_and_reuse_it_once_back():
    llm = LLM("builtin:tiny", num_kv_blocks=256)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with running_cluster("--kv-transfer", "store", "--prefill-nodes", "1", "--decode-nodes", "1",
                         "--num-kv-blocks", "256") as (url, proc):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        def check(prompt):
            r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            want = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
            assert r.choices[0].model_extra["token_ids"] == want

        check([(3 * i) % 200 + 20 for i in range(100)])
        old = node_pids(proc.pid)["redis"]
        os.kill(old, signal.SIGKILL)
        for k in range(3):  # while Redis is down or just restarted: still served, still exact
            check([(5 * i + k) % 200 + 20 for i in range(90)])
        wait_for(lambda: node_pids(proc.pid).get("redis") not in (None, old), timeout_s=30)
        port = int(_redis_port(node_pids(proc.pid)["redis"]))
        redis.Redis(port=port).ping()
        before = redis.Redis(port=port).dbsize()
        check([(11 * i) % 200 + 20 for i in range(128)])
        # The prefill node writes the new prompt's 8 blocks to the restarted Redis.
        wait_for(lambda: redis.Redis(port=port).dbsize() >= before + 8, timeout_s=10)


def _redis_port(pid: int) -> str:
    import psutil
    cmd = psutil.Process(pid).cmdline()
    if "--port" in cmd:
        return cmd[cmd.index("--port") + 1]
    return next(a.rsplit(":", 1)[-1] for a in cmd if ":" in a)
