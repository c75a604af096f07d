"""LoRA adapters through a real `pdserve up` 1P1D cluster over NIXL, driven by the official openai
client: a request picks an adapter by `model`, greedy tokens equal PEFT's PeftModel.generate in
float32 with the prefill and the decode node both applying the adapter; /v1/models lists the
adapters with their parent; adapters loaded and unloaded at run time, under load, lose no
request; a decode node started later gets the run-time adapters from the router."""
from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import threading

import httpx
import openai
import pytest
from lora_util import make_adapter, peft_greedy

from pdserve.testing.model_factory import make_model
from pdserve.testing.up_cluster import node_pids, node_stats, running_cluster, wait_for

NEW_TOKENS = 8
KEY = "lora-test-key"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_cluster")
    base = make_model(root, "llama")
    adapters = {"full": make_adapter(base, root / "full", seed=1, r=8, alpha=16),
                "rslora": make_adapter(base, root / "rslora", seed=2, r=4, alpha=8, use_rslora=True,
                                       targets=["q_proj", "v_proj", "gate_proj", "down_proj"]),
                "late": make_adapter(base, root / "late", seed=3, r=16, alpha=32)}
    rng = random.Random(1)
    shared = [rng.randrange(3, 200) for _ in range(20)]  # past a block: repeats hit the prefix caches
    prompts = [shared + [rng.randrange(3, 200) for _ in range(n)] for n in (5, 12)]
    want = {name: peft_greedy(base, path, prompts, NEW_TOKENS) for name, path in adapters.items()}
    want[str(base)] = peft_greedy(base, None, prompts, NEW_TOKENS)
    assert len({tuple(w[0]) for w in want.values()}) == len(want), "each adapter should change the output"
    flags = ("--model", str(base), "--kv-transfer", "nixl", "--num-kv-blocks", "128", "--api-key", KEY,
             "--lora-modules", f"full={adapters['full']}", f"rslora={adapters['rslora']}",
             "--max-loras", "2", "--max-lora-rank", "16")
    with running_cluster(*flags) as (url, proc):
        yield url, str(base), adapters, prompts, want, proc.pid


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, model: str, prompt: list[int], max_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy token ids; a longer run's first NEW_TOKENS are what PEFT's 8-token run gives."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].model_extra["token_ids"][:NEW_TOKENS]


def _streamed(client: openai.OpenAI, model: str, prompt: list[int], max_tokens: int, started: threading.Event) -> list[int]:
    """_complete's tokens, streamed: `started` is set at the first chunk, when the router holds the
    request in flight (an unload sent after it must wait for it)."""
    ids: list[int] = []
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}):
        started.set()
        for choice in chunk.choices:
            ids += choice.model_extra.get("token_ids") or []
    return ids[:NEW_TOKENS]


def _ends_with_router_paused(stream: cf.Future, up_pid: int, timeout_s: float = 30.0) -> list[int]:
    """The stream's result, read with the router stopped (SIGSTOP): only what it had sent."""
    router = node_pids(up_pid)["router"]
    os.kill(router, signal.SIGSTOP)
    try:
        return stream.result(timeout=timeout_s)
    except cf.TimeoutError:
        raise AssertionError("the unload answered before the adapter's request in flight ended") from None
    finally:
        os.kill(router, signal.SIGCONT)


def _admin(url: str, route: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/{route}", json=body, headers=headers, timeout=120)


def test_models_list_adapters_and_unknown_names_are_404(setup):
    url, base, adapters, _, _, _ = setup
    client = _client(url)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {base, "full", "rslora"}
    assert cards["full"].model_extra["parent"] == base and cards["full"].model_extra["root"] == str(adapters["full"])
    assert cards[base].model_extra["parent"] is None
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-adapter", prompt=[5, 6, 7], max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_each_adapter_matches_peft_across_prefill_and_decode(setup):
    url, base, _, prompts, want, _ = setup
    client = _client(url)
    cases = [(model, i) for i in range(len(prompts)) for model in (base, "full", "rslora")]
    for _ in range(2):  # the second round hits each adapter's own cached prefix
        with cf.ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(lambda c: _complete(client, c[0], prompts[c[1]]), cases))
        for (model, i), tokens in zip(cases, got):
            assert tokens == want[model][i], f"{model}, prompt {i}"
    # The node's counters reach the router with its pongs: wait for one after the last request.
    decode = wait_for(lambda: (lambda s: s if s["transfer_bytes_nixl"] > 0 else None)(node_stats(url)["decode-0"]),
                      timeout_s=30)
    assert decode["transfers_failed"] == 0  # the KV came over NIXL
    assert set(decode["loras"]) == {"full", "rslora"}


def _keep_busy(client, cases, want, stop: threading.Event) -> int:
    """Greedy requests round the cases until stopped, each checked against PEFT; how many ran."""
    done = 0
    while not stop.is_set():
        model, i = cases[done % len(cases)]
        assert _complete(client, model, want["prompts"][i], max_tokens=24) == want[model][i], (model, i)
        done += 1
    return done


def test_load_and_unload_at_run_time_under_load_lose_no_request(setup):
    url, base, adapters, prompts, want, up_pid = setup
    client = _client(url)
    late = {"lora_name": "late", "lora_path": str(adapters["late"])}
    assert _admin(url, "load_lora_adapter", late, key=None).status_code == 401
    stop = threading.Event()
    cases = [(base, 0), ("full", 1), ("rslora", 0), (base, 1)]
    with cf.ThreadPoolExecutor(6) as pool:
        busy = [pool.submit(_keep_busy, client, cases[k:] + cases[:k], {**want, "prompts": prompts}, stop)
                for k in range(3)]
        try:  # (a failure must stop the busy clients, or the pool's exit waits for them forever)
            r = _admin(url, "load_lora_adapter", late)
            assert r.status_code == 200, r.text
            assert [_complete(client, "late", p) for p in prompts] == want["late"]
            started = threading.Event()
            # in flight at the unload: 600 tokens outlast the unload's round trip, so a router
            # that answered without waiting is caught (200 had often ended by then)
            running = pool.submit(_streamed, client, "late", prompts[1], 600, started)
            assert started.wait(60)
            unload = _admin(url, "unload_lora_adapter", {"lora_name": "late"})
            assert unload.status_code == 200, unload.text
            # The unload waited for the adapter's request in flight: the router had sent all of
            # it before answering, so the stream ends whole with the router paused from now on.
            # (Asking running.done() at once raced the client's thread, which may still be reading
            # chunks already sent: it failed so on a loaded machine.)
            assert _ends_with_router_paused(running, up_pid) == want["late"][1]
        finally:
            stop.set()
        assert all(f.result() > 0 for f in busy)  # every request under load came back exact
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=prompts[0], max_tokens=2)
    assert _admin(url, "unload_lora_adapter", {"lora_name": "late"}).json()["error"]["type"] == "not_found_error"
    bad = _admin(url, "load_lora_adapter", {"lora_name": "bad", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    again = _admin(url, "load_lora_adapter", {"lora_name": "full", "lora_path": str(adapters["full"])})
    assert again.status_code == 400
    wait_for(lambda: all(n["free_blocks"] == n["total_blocks"] for n in node_stats(url).values()))


def test_a_node_started_later_gets_the_run_time_adapters(setup):
    url, base, adapters, prompts, want, _ = setup
    assert _admin(url, "load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])}).status_code == 200
    scaled = httpx.post(f"{url}/admin/scale", json={"decode": 2}, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=240)
    assert scaled.status_code == 200, scaled.text
    new = wait_for(lambda: [n for n in node_stats(url).values()
                            if n["role"] == "decode" and n["id"] != "decode-0" and "late" in n.get("loras", [])],
                   timeout_s=60)
    assert set(new[0]["loras"]) == {"full", "rslora", "late"}
    client = _client(url)
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: _complete(client, "late", p), prompts * 2))
    assert got == want["late"] * 2
