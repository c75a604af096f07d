"""A vision-language model across P/D: the official openai client sends chat requests with
images (data: URLs) to `pdserve up` on a tiny random Qwen2.5-VL, 1P1D over the store and over
NIXL; the greedy output equals the offline engine's (itself exact against transformers, see
test_qwen2_5_vl_engine.py). The prefill node encodes the images and hands over KV; the decode
node continues M-RoPE positions without encoding. Then: the same text with another image gets
no cached tokens beyond the text, the same image again does, and a decode node killed
mid-stream costs nothing (the next one resumes with the images the request carries).
Encoder nodes (E/P/D) are test_vlm_epd_cluster.py's.
"""
from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")

from pdserve.offline.llm import LLM  # noqa: E402
from pdserve.testing.up_cluster import (  # noqa: E402
    KILL_PACE,
    DecodeNodeKiller,
    node_stats,
    running_clusters,
    wait_for,
)
from pdserve.testing.vlm_chat import CASES, chat, content, data_url, offline, random_pictures  # noqa: E402
from pdserve.testing.vlm_checkpoints import make_qwen2_5_vl  # noqa: E402

LONG = 400  # with KILL_PACE, a stream long enough that a kill after token 20 lands mid-stream


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("vlm_cluster"))


@pytest.fixture(scope="module")
def pictures():
    return random_pictures()


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), block_size=16, num_kv_blocks=256)


@pytest.fixture(scope="module")
def clusters(checkpoint):
    # 256 blocks a node: the default half-gigabyte KV pool a node would take is memory CI lacks
    common = ("--model", str(checkpoint), "--served-model-name", "vlm", "--prefill-nodes", "1", "--num-kv-blocks", "256",
              *KILL_PACE)
    with running_clusters((*common, "--decode-nodes", "2", "--kv-transfer", "store"),
                          (*common, "--decode-nodes", "1", "--kv-transfer", "nixl")) as started:
        yield {"store": started[0], "nixl": started[1]}




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
    killer = DecodeNodeKiller(url, proc.pid)
    killed = killer.killed
    ids, _ = chat(url, "Tell a long story about ", [pictures[0]], ".", LONG, killer)
    assert killed, "the stream ended before a decode node could be killed"
    assert ids == offline(llm, "Tell a long story about ", [pictures[0]], ".", LONG)[0]
    wait_for(lambda: node_stats(url).get(killed[0], {}).get("healthy"), timeout_s=120)


def test_clients_with_images_and_the_encoder_metrics(clusters, llm, pictures):
    """responses.create with an input_image, LangChain's ChatOpenAI with an image message; the
    repeated picture is found in the prefill node's encoder cache (/health and /metrics)."""
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


def test_the_anthropic_sdk_sends_an_image_block(clusters, llm, pictures):
    """/v1/messages with a base64 image block: greedy text equal to the offline engine's, and the
    image's tokens counted in the usage (and in count_tokens) as the chat route counts them."""
    anthropic = pytest.importorskip("anthropic")
    url, _ = clusters["nixl"]
    _, prompt_tokens = offline(llm, "Look: ", [pictures[1]], " what is it?", 8)
    want = llm.get_tokenizer().decode(offline(llm, "Look: ", [pictures[1]], " what is it?", 8, ignore_eos=False)[0],
                                      skip_special_tokens=True)
    picture = data_url(pictures[1]).removeprefix("data:image/png;base64,")
    turn = [{"role": "user", "content": [
        {"type": "text", "text": "Look: "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": picture}},
        {"type": "text", "text": " what is it?"}]}]
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    message = client.messages.create(model="vlm", max_tokens=8, messages=turn, extra_body={"temperature": 0})
    assert message.content[0].text == want
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt_tokens
    assert client.messages.count_tokens(model="vlm", messages=turn).input_tokens == prompt_tokens
