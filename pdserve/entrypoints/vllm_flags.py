"""vLLM's `vllm serve` flags that pdserve's own commands do not take, in one table that drives both:

  * `pdserve serve` takes each with vLLM's meaning (add_serve_args), and after parsing either
    turns it into pdserve's settings or refuses it with why (apply_vllm_flags);
  * `pdserve up` refuses each with the pdserve equivalent (add_up_hints), instead of argparse's
    bare usage text.

vLLM flags that `pdserve up` already takes with vLLM's meaning (--dtype, --kv-cache-dtype,
--block-size, --max-num-seqs, --max-model-len, --served-model-name, --chat-template,
--tool-call-parser, --enable-lora, --lora-modules, --api-key, --host, --port, the TLS, CORS and
log flags of pdserve.entrypoints.http_flags) are not in the table: both commands take them as
they are. docs/from-vllm.md lists every one.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.entrypoints.kv_pool import kv_pool_from_utilization
from pdserve.models.gguf import find_gguf_file
from pdserve.models.model_path import HUB_ID, cached_snapshot, read_model_config, resolve_model_path

Check = Callable[[argparse.Namespace, Any], None]
QUANTIZATION_DOC = "docs/quantization.md"


@dataclass(frozen=True)
class VllmFlag:
    names: tuple[str, ...]  # vLLM's spellings
    serve: str  # what `pdserve serve` does with it (its --help)
    up: str  # `pdserve up`'s answer: the equivalent there, or why there is none
    kwargs: dict = field(default_factory=dict)  # argparse keywords on `pdserve serve`
    check: Check | None = None  # applies the value to args, or raises ValueError with why not

    @property
    def dest(self) -> str:
        return self.names[-1].lstrip("-").replace("-", "_")

    @property
    def switch(self) -> bool:
        return self.kwargs.get("action") in ("store_true", argparse.BooleanOptionalAction)


def _accept(args: argparse.Namespace, value: Any) -> None:
    """Taken as it is: the nodes or the router read it from args (--seed), or it changes nothing."""


def _only(allowed: Any, why: str) -> Check:
    def check(args: argparse.Namespace, value: Any) -> None:
        if value != allowed:
            raise ValueError(why)
    return check


def _tensor_parallel(args: argparse.Namespace, value: int) -> None:
    if value < 1:
        raise ValueError("a tensor-parallel size is at least 1")
    if tuple(args.prefill_tp) != (1,) or tuple(args.decode_tp) != (1,):  # given with --prefill-tp/--decode-tp
        raise ValueError("-tp sets both roles' size: give it, or --prefill-tp and --decode-tp, not both")
    args.prefill_tp = args.decode_tp = (value,)  # with --prefill-nodes 0, the decode nodes' alone


def _pipeline_parallel(args: argparse.Namespace, value: int) -> None:
    if value < 1:
        raise ValueError("a pipeline-parallel size is at least 1")
    if tuple(args.prefill_pp) != (1,) or tuple(args.decode_pp) != (1,):  # given with --prefill-pp/--decode-pp
        raise ValueError("-pp sets both roles' stages: give it, or --prefill-pp and --decode-pp, not both")
    args.prefill_pp = args.decode_pp = (value,)


def _gpu_memory(args: argparse.Namespace, value: float) -> None:
    args.kv_cache_memory_gb = kv_pool_from_utilization(args, value)


def checkpoint_quantization(model: str) -> str | None:
    """How the checkpoint's weights are quantized, as vLLM's --quantization names it: gguf, the
    config's quant_method (compressed-tensors, fp8, mxfp4, ...), or None for float weights."""
    if not model.startswith("builtin:") and find_gguf_file(model) is not None:
        return "gguf"
    config = vars(read_model_config(resolve_model_path(model)))
    method = (config.get("quantization_config") or {}).get("quant_method")
    return str(method).replace("_", "-") if method else None


def _quantization(args: argparse.Namespace, value: str) -> None:
    want, have = value.replace("_", "-"), checkpoint_quantization(args.model)
    if have is None:
        raise ValueError(f"{args.model} holds unquantized weights, and pdserve does not quantize as it loads: "
                         f"serve a checkpoint quantized as {value} ({QUANTIZATION_DOC}), or drop -q")
    if want != have:
        raise ValueError(f"{args.model} is quantized as {have}, not {value}: drop -q (pdserve reads the format "
                         f"from the checkpoint) or pass -q {have}")


def _tokenizer(args: argparse.Namespace, value: str) -> None:
    try:
        if value == args.model or resolve_model_path(value).resolve() == resolve_model_path(args.model).resolve():
            return
    except ValueError:  # not a model directory: refused below
        pass
    raise ValueError("pdserve reads the tokenizer from the model's own directory (the router and the nodes must "
                     f"tokenize alike): copy {value}'s tokenizer files into {args.model}")


def _revision(args: argparse.Namespace, value: str) -> None:
    """The cached snapshot of that revision becomes the model, still served under its id."""
    if not HUB_ID.fullmatch(args.model) or Path(args.model).expanduser().exists():
        raise ValueError(f"{args.model} is not a Hub id (ORG/NAME): a local directory has one revision, and "
                         "pdserve never downloads")
    if not args.served_model_name:
        args.served_model_name = [args.model]
    args.model = str(cached_snapshot(args.model, value))


VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(("-tp", "--tensor-parallel-size"),
             "tensor-parallel size of every node, prefill and decode (--prefill-tp and --decode-tp)",
             "each role has its own: --prefill-tp N --decode-tp N", dict(type=int, metavar="N"), _tensor_parallel),
    VllmFlag(("--gpu-memory-utilization",),
             "CUDA: the share of the GPU's memory for the nodes on it, weights and KV pool (sets "
             "--kv-cache-memory-gb); refused on CPU, where --kv-cache-memory-gb sizes the pool",
             "size the KV pool itself: --kv-cache-memory-gb GB or --num-kv-blocks N",
             dict(type=float, metavar="FRACTION"), _gpu_memory),
    VllmFlag(("-q", "--quantization"),
             "checks that the checkpoint is quantized this way (pdserve reads the format from the checkpoint "
             "and does not quantize as it loads)",
             f"not needed: pdserve reads the quantization from the checkpoint ({QUANTIZATION_DOC})",
             dict(metavar="METHOD"), _quantization),
    VllmFlag(("--seed",), "seeds each node's sampler, for requests that give no seed of their own",
             "give requests their own `seed`", dict(type=int), _accept),
    VllmFlag(("--tokenizer",), "accepted when it names the model itself: pdserve reads the tokenizer "
             "from the model's directory", "pdserve reads the tokenizer from --model's directory", {}, _tokenizer),
    VllmFlag(("--revision",), "a Hub id's revision (a branch, tag or commit), from the local Hugging Face cache: "
             "pdserve never downloads",
             "--model ORG/NAME serves the local Hugging Face cache's refs/main; `pdserve serve ORG/NAME --revision "
             "REV` another revision the cache holds (pdserve never downloads)", {}, _revision),
    VllmFlag(("--trust-remote-code",), "refused: pdserve runs no code from a checkpoint",
             "pdserve runs no code from a checkpoint: it serves the architectures it implements (docs/models.md)",
             dict(action="store_true")),
    VllmFlag(("--enable-auto-tool-choice",), "accepted: pdserve always parses tool calls under tool_choice auto",
             "not needed: pdserve always parses tool calls under tool_choice auto (--tool-call-parser picks the "
             "format)", dict(action="store_true"), _accept),
    VllmFlag(("--reasoning-parser",), "refused: pdserve has no reasoning parsers",
             "pdserve has no reasoning parsers: a model's reasoning stays in the message content", {}),
    VllmFlag(("--generation-config",), "vllm only: pdserve applies no generation_config.json defaults",
             "pdserve applies no sampling defaults from generation_config.json (vLLM's --generation-config vllm): "
             "requests set their own", {},
             _only("vllm", "pdserve applies no sampling defaults from generation_config.json: only "
                           "--generation-config vllm (requests set their own parameters)")),
    VllmFlag(("-pp", "--pipeline-parallel-size"),
             "pipeline stages of every node, prefill and decode (--prefill-pp and --decode-pp)",
             "each role has its own: --prefill-pp N --decode-pp N", dict(type=int, metavar="N"), _pipeline_parallel),
    VllmFlag(("-dp", "--data-parallel-size"), "1 only: pdserve's replicas are its nodes (--decode-nodes)",
             "pdserve's replicas are its nodes: --decode-nodes N (and --prefill-nodes M)",
             dict(type=int, metavar="N"),
             _only(1, "pdserve's replicas are its nodes: --decode-nodes N (and --prefill-nodes M)")),
    VllmFlag(("--enable-chunked-prefill",), "on only: pdserve always chunks prefills (--max-num-batched-tokens)",
             "not needed: pdserve always chunks prefills, --max-num-batched-tokens tokens a step",
             dict(action=argparse.BooleanOptionalAction),
             _only(True, "pdserve always chunks prefills: --max-num-batched-tokens sets the chunk")),
    VllmFlag(("--max-logprobs",), "20 only: the router's fixed limit, OpenAI's",
             "not needed: the router returns up to 20 logprobs, OpenAI's limit", dict(type=int),
             _only(20, "the router's limit is fixed at 20 logprobs (OpenAI's)")),
    VllmFlag(("--response-role",), "assistant only: the role of every chat reply",
             "not needed: chat replies have the role assistant", {},
             _only("assistant", "chat replies always have the role assistant")),
    VllmFlag(("--return-tokens-as-token-ids",), "refused: logprobs name tokens by their text",
             "logprobs name tokens by their text; /tokenize and /detokenize map text and ids",
             dict(action="store_true")),
)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The table's flags, as `pdserve serve` takes them (default None: not given)."""
    for flag in VLLM_FLAGS:
        p.add_argument(*flag.names, dest=flag.dest, help=flag.serve,
                       **({"default": None} | flag.kwargs))


def apply_vllm_flags(args: argparse.Namespace) -> None:
    """Each vLLM flag given: into pdserve's settings, or a ValueError that says why not (a flag
    with no check is always refused, with its `up` text)."""
    for flag in VLLM_FLAGS:
        value = getattr(args, flag.dest)
        if value is None or (value is False and flag.kwargs.get("action") == "store_true"):
            continue
        try:
            if flag.check is None:
                raise ValueError(flag.up)
            flag.check(args, value)
        except ValueError as exc:
            shown = {True: flag.names[-1], False: f"--no-{flag.names[-1][2:]}"}.get(value, f"{flag.names[-1]} {value}")
            raise ValueError(f"{shown}: {exc}") from None


class _Hint(argparse.Action):
    """A vLLM flag `pdserve up` does not take: exit with its equivalent, not argparse's usage."""

    def __init__(self, option_strings, dest, hint: str, serve_takes: bool, **kwargs):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.hint, self.serve_takes = hint, serve_takes

    def __call__(self, parser, namespace, values, option_string=None):
        serve = f"; `pdserve serve MODEL {option_string} ...` takes vLLM's flag" if self.serve_takes else ""
        parser.exit(2, f"{parser.prog}: error: {option_string} (vLLM's) is not taken here: {self.hint}{serve}\n")


def add_up_hints(p: argparse.ArgumentParser) -> None:
    """Each table flag `p` does not take answers with its pdserve equivalent."""
    for flag in VLLM_FLAGS:
        names = list(flag.names)
        if flag.kwargs.get("action") is argparse.BooleanOptionalAction:
            names += [f"--no-{n[2:]}" for n in flag.names]
        names = [n for n in names if n not in p._option_string_actions]
        if names:
            p.add_argument(*names, dest=f"vllm_{flag.dest}", action=_Hint, hint=flag.up, serve_takes=flag.check is not None,
                           nargs=0 if flag.switch else None, default=argparse.SUPPRESS)


def brief_errors(p: argparse.ArgumentParser) -> None:
    """`p`'s argparse errors in one line with where to look, not its whole usage text."""
    def error(message: str):
        p.exit(2, f"{p.prog}: error: {message} (`{p.prog} --help` lists its flags; docs/from-vllm.md maps vLLM's)\n")
    p.error = error  # type: ignore[method-assign]
