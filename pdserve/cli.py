"""The `pdserve` command: one subcommand per job."""
from __future__ import annotations

import argparse
import logging
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:tiny", help="local Hugging Face directory or builtin:tiny")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "numba", "triton"])


def engine_options(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs, kernel_backend=args.kernel_backend)


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams
    llm = LLM(args.model, **engine_options(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in llm.generate(args.prompts or ["Hello, my name is"], params):
        print(f"prompt: {out.prompt!r}\noutput: {out.outputs[0].text!r} "
              f"({len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation, printed to stdout")
    _add_engine_args(gen)
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:  # bad flags or model: a clear message, not a traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
