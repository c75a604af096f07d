"""The router's flags, as `pdserve router` and `pdserve up` take them: admission, routing and
placement, chat templates and tool parsing, served model names."""
from __future__ import annotations

import argparse

from pdserve.router.openai.tool_parsers import PARSERS
from pdserve.router.placement.policy import PLACEMENTS, POLICIES
from pdserve.router.routes.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUED_REQUESTS

# Up to this many missing prompt tokens the decode node prefills them itself instead of taking a
# prefill node's round trip and a KV handover. Measured on the 2-core CI machine
# (benchmarks/serving/bench_local_prefill.py): local prefill gave the lower TTFT at every size up to 512
# missing tokens, but it stalls the decode batch for ~0.15 ms per token; with 4 streams decoding
# beside it, the TTFT gained equals the stall summed over those streams at about 32 tokens.
DEFAULT_LOCAL_PREFILL_THRESHOLD = 32

def add_admission_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                   "(default: $PDSERVE_API_KEY; none: open). Several keys: KEY1,KEY2; KEY:TENANT names the "
                   "key's tenant, whose cached KV no other tenant shares (docs/adapters-and-tenants.md)")
    p.add_argument("--protect-metrics", action="store_true", help="require the API key on /health and /metrics too")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="generation requests in flight before the router answers 429 with Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file, replacing the tokenizer's (without either, "
                        "/v1/chat/completions answers 400)")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="how tool calls are parsed out of text under tool_choice 'auto' (default: the chat "
                        "template's format)")
    p.add_argument("--pooling", choices=["last", "mean"], default=None,
                   help="how /v1/embeddings pools a prompt's final hidden states: the last token's or the mean "
                        "(default: the checkpoint's sentence-transformers pooling, else last)")


def add_served_name_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names requests may give in `model`; the first is the model's id in responses and "
                        "/v1/models (default: --model as given)")


def add_routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-policy", choices=POLICIES, default="cache_aware", help="how a prefill node is picked")
    p.add_argument("--decode-policy", choices=POLICIES, default="cache_aware", help="how a decode node is picked")
    p.add_argument("--local-prefill-threshold", type=int, default=DEFAULT_LOCAL_PREFILL_THRESHOLD,
                   help="the decode node prefills itself when it lacks at most this many prompt tokens")
    p.add_argument("--prefill-placement", choices=PLACEMENTS, default="slo",
                   help="where prompts are prefilled: slo (per request, from the prefill queue, the decode "
                        "node's batch and step times, and the --ttft-slo-ms/--itl-slo-ms targets or the "
                        "request's own; decode nodes then cap their prefill chunks to hold the ITL target) or "
                        "threshold (on a prefill node unless --local-prefill-threshold says otherwise, however "
                        "long its queue)")
    p.add_argument("--handover", choices=["pull", "push"], default="pull",
                   help="when a request prefilled remotely reaches its decode node: pull (once the prefill node "
                        "has computed the prompt; the decode node then pulls its KV) or push (at once, beside the "
                        "prompt, so the decode node allocates its blocks and waits in WAITING_FOR_REMOTE_KVS while "
                        "the prompt computes; the first token and the handover follow it there)")
    p.add_argument("--session-affinity", action="store_true",
                   help="keep requests with the same OpenAI `user` on the decode node that served the last one")
