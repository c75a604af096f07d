"""What a modelled node's work costs, and how to measure it on the real engine.

The defaults are the built-in model measured on this project's 2-core CI machine with one thread
per node (`pdserve simulate --calibrate` prints fresh figures as JSON, and `--costs FILE` reads
them back). Transfers use bench_nixl / bench_kvstore figures for that model's 16-token blocks.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

from pdserve.protocol.sampling_params import SamplingParams


@dataclass
class NodeCosts:
    prefill_s_per_token: float = 1.5e-4   # computing one prompt token
    store_s_per_token: float = 1.5e-5     # loading one prompt token's KV from the store instead
    decode_step_s: float = 4.0e-3         # one decode step's fixed part (launches, sampling)
    decode_s_per_seq: float = 2.5e-4      # ... and its part per running sequence
    transfer_s_per_block: float = 2.0e-5  # handing one KV block from a prefill to a decode node
    handover_s: float = 2.0e-3            # the handover's fixed round trip
    block_bytes: int = 65536              # one KV block (bytes moved per block handed over)
    router_s: float = 3.0e-3              # HTTP, tokenizing and planning (bench_router_overhead)

    @classmethod
    def load(cls, path: str) -> NodeCosts:
        with open(path) as f:
            return cls(**json.load(f))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _timed_generate(llm, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0


def calibrate(model: str = "builtin:tiny", threads: int = 1, repeats: int = 3) -> NodeCosts:
    """Measure the engine's prefill and decode costs (medians of `repeats`) in this process."""
    # torch and the engine, only to calibrate: the simulator itself runs without them.
    import torch

    from pdserve.offline.llm import LLM  # torch and the engine, as above
    torch.set_num_threads(threads)
    llm = LLM(model, enable_prefix_caching=False)
    engine = llm.engine
    prompt_len, decode_tokens, batch = 512, 32, 16
    vocab = min(len(engine.tokenizer), 250)

    def prompts(n: int, length: int, salt: int) -> list[list[int]]:
        return [[(salt * 7 + i * 13 + j) % vocab for j in range(length)] for i in range(n)]
    _timed_generate(llm, prompts(2, 64, 0), 4)  # warm-up
    prefill = statistics.median(_timed_generate(llm, prompts(1, prompt_len, r), 1) / prompt_len
                                for r in range(repeats))
    step = {}
    for n in (1, batch):
        runs = [_timed_generate(llm, prompts(n, 16, r), decode_tokens) for r in range(repeats)]
        step[n] = statistics.median(runs) / decode_tokens
    per_seq = max((step[batch] - step[1]) / (batch - 1), 0.0)
    layer_bytes = engine.kv_cache[0].numel() * engine.kv_cache.element_size()
    return NodeCosts(prefill_s_per_token=prefill, decode_step_s=max(step[1] - per_seq, 0.0),
                     decode_s_per_seq=per_seq, block_bytes=layer_bytes)
