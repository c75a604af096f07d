"""`pdserve serve MODEL [flags]`: the `vllm serve` of pdserve.

It is `pdserve up` (the same P/D layout flags and defaults: one prefill and one decode node) with
the model first, as vLLM takes it, and vLLM's common flags with vLLM's meaning
(pdserve.entrypoints.vllm_flags): each is turned into pdserve's settings before any process
starts, or refused with a message that names the pdserve equivalent or says why.
"""
from __future__ import annotations

import argparse

from pdserve.entrypoints.http_flags import check_tls
from pdserve.entrypoints.launcher import run_up
from pdserve.entrypoints.vllm_flags import apply_vllm_flags


def serve_settings(args: argparse.Namespace) -> argparse.Namespace:
    """args with MODEL and the vLLM flags applied: what `pdserve up` runs (ValueError: refused)."""
    if args.model_tag:
        args.model = args.model_tag
    check_tls(args)
    apply_vllm_flags(args)
    return args


def run_serve(args: argparse.Namespace) -> int:
    return run_up(serve_settings(args))
