"""A vision-language model across P/D: the official openai client sends chat requests with
images (data: URLs) to `pdserve up` on a tiny random Qwen2.5-VL, 1P1D over the store and over
NIXL (and on a tiny Gemma 3, whose image tokens attend both ways, through the store); the greedy output equals the offline engine's (itself exact against transformers, see
test_qwen2_5_vl_engine.py). The prefill node encodes the images and hands over KV; the decode
node continues M-RoPE positions without encoding. Then: the same text with another image gets
no cached tokens beyond the text, the same image again does, and a decode node killed
mid-stream costs nothing (the next one resumes with the images the request carries).
"""
from __future__ import annotations

import base64
import io
import os
import signal

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")

from pdserve.offline.llm import LLM  # noqa: E402
from pdserve.protocol.sampling_params import SamplingParams  # noqa: E402
from pdserve.testing.up_cluster import node_pids, node_stats, running_cluster, running_clusters, wait_for  # noqa: E402
from pdserve.testing.vlm_checkpoints import make_gemma3_vl, make_qwen2_5_vl  # noqa: E402

SIZES = [(112, 140), (196, 84), (84, 112)]
LONG = 400  # a stream long enough that a kill after token 20 lands mid-stream


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("vlm_cluster"))


@pytest.fixture(scope="module")
def pictures():
    rng = np.random.RandomState(1)
    return [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), block_size=16)


@pytest.fixture(scope="module")
def clusters(checkpoint):
    common = ("--model", str(checkpoint), "--served-model-name", "vlm", "--prefill-nodes", "1")
    with running_clusters((*common, "--decode-nodes", "2", "--kv-transfer", "store"),
                          (*common, "--decode-nodes", "1", "--kv-transfer", "nixl")) as started:
        yield {"store": started[0], "nixl": started[1]}


def data_url(picture) -> str:
    buf = io.BytesIO()
    picture.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def content(before: str, images, after: str) -> list[dict]:
    return [{"type": "text", "text": before}, *({"type": "image_url", "image_url": {"url": data_url(p)}}
                                                for p in images), {"type": "text", "text": after}]


def offline(llm, before: str, images, after: str, max_tokens: int, ignore_eos: bool = True) -> tuple[list[int], int]:
    parts = [{"type": "text", "text": before}, *[{"type": "image"}] * len(images), {"type": "text", "text": after}]
    text = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                                   tokenize=False)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                       SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos), use_tqdm=False)[0]
    return out.outputs[0].token_ids, len(out.prompt_token_ids)


def chat(url: str, before: str, images, after: str, max_tokens: int = 8, on_token=None):
    """(token ids, usage) of a streamed greedy chat completion."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": content(before, images, after)}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True})
    ids, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            if on_token is not None:
                on_token(len(ids))
    return ids, usage


CASES = [("Look: ", [0], " what is it?"), ("Two pictures ", [0, 1], " compared.")]


@pytest.mark.parametrize("transfer", ["store", "nixl"])
def test_greedy_chat_with_images_equals_offline(clusters, llm, pictures, transfer):
    url, _ = clusters[transfer]
    for before, which, after in CASES:
        images = [pictures[i] for i in which]
        ids, usage = chat(url, before, images, after)
        want, prompt_tokens = offline(llm, before, images, after, 8)
        assert ids == want, (transfer, before)
        assert usage.prompt_tokens == prompt_tokens  # the image tokens are counted
    # (node stats ride on pings: wait for the next)
    wait_for(lambda: sum(s.get("prefills_handed_over", 0) for s in node_stats(url).values()
                         if s["role"] == "decode") >= len(CASES), timeout_s=10)


def test_another_image_never_hits_the_same_image_does(clusters, llm, pictures):
    url, _ = clusters["store"]
    before, after = "Please describe this picture: ", " in detail, and nothing else."
    first, _ = chat(url, before, [pictures[2]], after)
    other, usage_other = chat(url, before, [pictures[1]], after)
    again, usage_again = chat(url, before, [pictures[2]], after)
    text_blocks = 32  # <|user|>, 30 bytes and <|vision_start|>: all that precedes the image
    assert usage_other.prompt_tokens_details.cached_tokens <= text_blocks
    assert other == offline(llm, before, [pictures[1]], after, 8)[0] != first
    assert usage_again.prompt_tokens_details.cached_tokens > text_blocks
    assert again == first


def test_decode_node_killed_mid_stream_resumes_identically(clusters, llm, pictures):
    url, proc = clusters["store"]
    killed: list[str] = []

    def kill_serving_decode_node(n_tokens: int) -> None:
        if n_tokens < 20 or killed:
            return
        busy = [n for n, s in node_stats(url).items() if s["role"] == "decode" and s["routed_requests"]]
        if busy:
            killed.append(busy[0])
            os.kill(node_pids(proc.pid)[busy[0]], signal.SIGKILL)

    ids, _ = chat(url, "Tell a long story about ", [pictures[0]], ".", LONG, kill_serving_decode_node)
    assert killed, "the stream ended before a decode node could be killed"
    assert ids == offline(llm, "Tell a long story about ", [pictures[0]], ".", LONG)[0]
    wait_for(lambda: node_stats(url).get(killed[0], {}).get("healthy"), timeout_s=120)


def test_clients_with_images_and_the_encoder_metrics(clusters, llm, pictures):
    """responses.create with an input_image, LangChain's ChatOpenAI with an image message; the
    repeated picture is found in the prefill node's encoder cache (/health and /metrics)."""
    import httpx  # the test extra's: /metrics is plain text
    langchain_openai = pytest.importorskip("langchain_openai")
    url, _ = clusters["nixl"]
    ids = offline(llm, "Look: ", [pictures[0]], " what is it?", 8, ignore_eos=False)[0]
    want = llm.get_tokenizer().decode(ids, skip_special_tokens=True)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    response = client.responses.create(model="vlm", max_output_tokens=8, temperature=0,
                                       input=[{"role": "user", "content": [
                                           {"type": "input_text", "text": "Look: "},
                                           {"type": "input_image", "image_url": data_url(pictures[0])},
                                           {"type": "input_text", "text": " what is it?"}]}])
    assert response.output_text == want
    chat_model = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key="none", model="vlm", max_tokens=8,
                                             temperature=0, max_retries=0)
    # Other text before the same picture: no prefix hit reaches the image, the encoder cache does
    message = chat_model.invoke([{"role": "user", "content": content("Here: ", [pictures[0]], " what is it?")}])
    ids = offline(llm, "Here: ", [pictures[0]], " what is it?", 8, ignore_eos=False)[0]
    assert message.content == llm.get_tokenizer().decode(ids, skip_special_tokens=True)
    wait_for(lambda: next(s for s in node_stats(url).values() if s["role"] == "prefill").get("encoder_cache_hits"),
             timeout_s=10)
    assert "pdserve_encoder_cache_hits_total" in httpx.get(f"{url}/metrics", timeout=10).text


def test_gemma3_chat_with_images_equals_offline(tmp_path_factory, pictures):
    """Gemma 3, 16 tokens a prefill step (the prefill node never cuts an image across chunks),
    E/P/D with its KV over NIXL and the embeddings through a Redis."""
    from pdserve.testing.redis_server import redis_server  # the test extra's: a real redis-server
    path = make_gemma3_vl(tmp_path_factory.mktemp("gemma3_cluster"))
    gemma = LLM(str(path), block_size=16)
    common = ("--model", str(path), "--served-model-name", "vlm", "--prefill-nodes", "1", "--decode-nodes", "1",
              "--max-num-batched-tokens", "16")
    with redis_server() as (redis_url, _), running_cluster(
            *common, "--kv-transfer", "nixl", "--store", redis_url, "--encode-nodes", "1") as (url, _):
        for before, which, after in CASES:
            images = [pictures[i] for i in which]
            ids, usage = chat(url, before, images, after)
            want, prompt_tokens = offline(gemma, before, images, after, 8)
            assert ids == want and usage.prompt_tokens == prompt_tokens, before
        wait_for(lambda: _stat(url, "encode", "encoder_runs") == 2, timeout_s=10)
        assert _stat(url, "prefill", "encoder_runs") == 0


def _stat(url: str, role: str, name: str) -> int:
    return sum(s.get(name, 0) for s in node_stats(url).values() if s["role"] == role and s["healthy"])


def test_encoder_node_encodes_and_a_lost_one_costs_nothing(checkpoint, llm, pictures):
    """E/P/D: the encoder node encodes, the prefill node loads the embeddings from the store and
    encodes nothing; the same picture behind other text is an encoder-cache hit there; with the
    encoder node killed, the prefill node encodes by itself, with the same output."""
    with running_cluster("--model", str(checkpoint), "--served-model-name", "vlm", "--encode-nodes", "1",
                         "--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "store") as (url, proc):
        for before, which, after in CASES:
            images = [pictures[i] for i in which]
            assert chat(url, before, images, after)[0] == offline(llm, before, images, after, 8)[0]
        # picture 0 loaded once: the prefill node keeps it in its own encoder cache for the second prompt
        wait_for(lambda: _stat(url, "prefill", "embeddings_loaded") >= 2, timeout_s=10)
        assert _stat(url, "encode", "encoder_runs") == 2 and _stat(url, "prefill", "encoder_runs") == 0
        assert chat(url, "Again: ", [pictures[1]], "?")[0] == offline(llm, "Again: ", [pictures[1]], "?", 8)[0]
        wait_for(lambda: _stat(url, "encode", "encoder_cache_hits") >= 2, timeout_s=10)
        os.kill(node_pids(proc.pid)["encode-0"], signal.SIGKILL)
        assert chat(url, "Lost: ", [pictures[2]], "?")[0] == offline(llm, "Lost: ", [pictures[2]], "?", 8)[0]
        wait_for(lambda: _stat(url, "prefill", "encoder_runs") >= 1, timeout_s=10)
        assert httpx.get(f"{url}/health", timeout=5).json()["failover"]["encodes_remote"] == 3
