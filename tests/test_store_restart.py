"""The store is the cluster-wide tier: a prompt written to Redis by a prefill node is reused by
that node's next life after a SIGKILL and restart (its local cache is gone), and the output is
the offline engine's."""
from __future__ import annotations

import os
import signal

import openai

from cluster_util import node_pids, node_stats, running_cluster, wait_for
from pdserve import LLM, SamplingParams


def test_prefill_restart_between_writer_and_reader_still_reuses_the_store():
    prefix = [(7 * i) % 200 + 20 for i in range(160)]
    prompts = [prefix + [30, 31, 32], prefix + [40, 41, 42, 43]]
    llm = LLM("builtin:tiny", num_kv_blocks=256)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with running_cluster("--kv-transfer", "store", "--prefill-nodes", "1", "--decode-nodes", "1",
                         "--num-kv-blocks", "256") as (url, proc):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        def complete(prompt):
            r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            return r.choices[0].model_extra["token_ids"]
        assert complete(prompts[0]) == llm.generate({"prompt_token_ids": prompts[0]}, params,
                                                    use_tqdm=False)[0].outputs[0].token_ids
        old = node_pids(proc.pid)["prefill-0"]
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: node_pids(proc.pid).get("prefill-0") not in (None, old), timeout_s=30)
        wait_for(lambda: node_stats(url)["prefill-0"]["healthy"], timeout_s=60)
        assert complete(prompts[1]) == llm.generate({"prompt_token_ids": prompts[1]}, params,
                                                    use_tqdm=False)[0].outputs[0].token_ids
        # The new process computed only the tail: its 160-token prefix came from Redis.
        wait_for(lambda: node_stats(url)["prefill-0"]["cached_tokens_store"] >= 160, timeout_s=10)
