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
from pdserve.models.model_path import context_limit, read_model_config, resolve_model_path


def serve_settings(args: argparse.Namespace) -> argparse.Namespace:
    """args with MODEL and the vLLM flags applied: what `pdserve up` runs (ValueError: refused)."""
    if args.model_tag:
        args.model = args.model_tag
    check_tls(args)
    apply_vllm_flags(args)  # --revision first: it names the snapshot check_model resolves
    check_model(args)
    return args


def check_model(args: argparse.Namespace) -> None:
    """Before any process starts (ValueError: `pdserve` exits with code 2 and this one message):
    the model resolves (a directory, an installed GGUF, or a Hub id in the local Hugging Face
    cache), and --max-model-len is within what its config allows. As vLLM refuses a longer one
    unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set, pdserve refuses it unless
    --allow-long-max-model-len is given: the nodes then extend RoPE past the config's positions."""
    path = resolve_model_path(args.model)
    wanted = getattr(args, "max_model_len", None)
    if wanted is not None and wanted < 1:
        raise ValueError(f"--max-model-len must be at least 1, got {wanted}")
    config = read_model_config(path)
    limit = context_limit(config)
    if wanted is None or limit is None or wanted <= limit or getattr(args, "allow_long_max_model_len", False):
        return
    raise ValueError(f"--max-model-len {wanted} is more than {args.model} allows: its config.json's "
                     f"max_position_embeddings is {limit}. Leave --max-model-len out to serve the model's {limit}, "
                     f"give a value up to it, or add --allow-long-max-model-len to serve {wanted} anyway (vLLM's "
                     f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1): positions past {limit} are ones the model was not trained "
                     "on, and its output there may be poor")


def run_serve(args: argparse.Namespace) -> int:
    return run_up(serve_settings(args))


def run_checked_up(args: argparse.Namespace) -> int:
    """`pdserve up`: the model checked first (check_model), then the cluster."""
    check_model(args)
    return run_up(args)
