"""Engine settings shared by the offline API and both node kinds."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.speculative_config import parse_speculative_config


@dataclass
class EngineConfig:
    model: str = "builtin:tiny"
    dtype: str = "auto"  # auto -> float32 on CPU, bfloat16 on CUDA
    # The paged KV cache's element type: auto (the model's dtype; bfloat16 for a K/V cache on CPU
    # under bf16 or int8 products, pdserve.assembly.build.auto_kv_dtype), fp8 (float8_e4m3fn with
    # per-layer scales, see pdserve.kernels.fp8_kv) or bfloat16.
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    # KV memory: an explicit block count wins over the memory budget; neither set: a share of the
    # machine's available memory (pdserve.engine.kv_pool_size), for LLM(...) as for a node. A fixed
    # 0.5 GB had been LLM's default: 1,456 blocks of SmolLM2, so 128 requests of 160 + 128 tokens
    # preempted 48 times and took 251 steps instead of 138 (681-848 against 903-1,035 tokens/s).
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    # Write the CPU pool's pages at start (as vLLM allocates its cache) instead of a chunk ahead of
    # the blocks handed out (pdserve.assembly.pool_pages). The flag's default: on where the
    # operator gave the pool's size (prefault_default).
    kv_cache_prefault: bool = False
    # A step's tokens (prefill chunks); None: assembly.setup.step_tokens's, once the products are chosen.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 128
    max_model_len: int | None = None
    # max_model_len past the config's max_position_embeddings (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN):
    # refused unless set; then RoPE runs past the positions the model was trained on.
    allow_long_max_model_len: bool = False
    enable_prefix_caching: bool = True
    # Seconds a request may wait in WAITING_FOR_REMOTE_KVS before it is computed locally.
    remote_kv_timeout_s: float = 30.0
    kernel_backend: str = "auto"  # auto | torch | numba | triton
    # The dtype of quantized weights' many-row products on CPU (prefill; decode steps past the
    # compiled step's rows): float32 (exact against a float32 reference) or bfloat16 (on CPUs with
    # AMX or AVX-512 BF16: 2.7-4.7x faster tiles; see pdserve.kernels.dequant_tiles). auto:
    # int8 for a GGUF on a CPU with VNNI (no AMX), else bfloat16 where the CPU has it, else float32
    # ($PDSERVE_CPU_GEMM_DTYPE, where set, decides).
    # int8: 4- and 8-bit matrices (GGUF's Q4_0/Q4_1/Q8_0...) multiply int8-quantized activations
    # with AVX-512 VNNI at every row count, as llama.cpp does; the rest as bfloat16.
    cpu_gemm_dtype: str = "auto"
    # True: no CUDA graphs, every step launched op by op (vLLM's --enforce-eager). CUDA only.
    enforce_eager: bool = False
    # Overlap a decode step's host work with the GPU's (vLLM's async scheduling): "auto" (on
    # CUDA only), True or False.
    async_scheduling: bool | str = "auto"
    seed: int = 0
    # Ranks the model is split over (pdserve.executor): this process and size - 1 workers.
    tensor_parallel_size: int = 1
    # Pipeline stages the layers are split over (pdserve.executor), each with
    # tensor_parallel_size ranks: this process and pipeline * tensor - 1 workers.
    pipeline_parallel_size: int = 1
    # MoE at TP > 1: partition the experts across ranks instead of splitting each expert.
    enable_expert_parallel: bool = False
    # Compute threads of each rank at TP > 1 (default: this process's share of cores / size).
    threads_per_rank: int | None = None
    # Speculative decoding (pdserve.spec_decode): vLLM's --speculative-config, as a JSON string,
    # a dict or a SpeculativeConfig; None: off.
    speculative_config: Any = None
    # LoRA adapters (pdserve.lora), as vLLM names the settings: lora_modules {name: PEFT dir}
    # registered at start (and turns adapters on); max_loras resident at once in a step,
    # max_lora_rank the largest rank accepted, max_cpu_loras host copies kept (>= max_loras).
    enable_lora: bool = False
    lora_modules: dict[str, str] | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Vision-language models: image embeddings kept by content hash (pdserve.engine.multimodal),
    # in embedding rows (tokens); 0: none kept, every step that needs an image encodes it.
    encoder_cache_tokens: int = 16384
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.kv_cache_dtype not in ("auto", "fp8", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be auto, fp8 or bfloat16, got {self.kv_cache_dtype!r}")
        if self.cpu_gemm_dtype not in ("auto", "float32", "bfloat16", "int8"):
            raise ValueError(f"cpu_gemm_dtype must be auto, float32, bfloat16 or int8, got {self.cpu_gemm_dtype!r}")
        if self.kernel_backend not in ("auto", "torch", "numba", "triton"):
            raise ValueError(f"kernel_backend must be auto, torch, numba or triton, got {self.kernel_backend!r}")
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.lora_modules:
            self.enable_lora = True
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        """What does not run over pipeline stages yet, refused at start with the pair named."""
        if self.pipeline_parallel_size == 1:
            return
        spec = self.speculative_config
        if spec is not None and spec.method in ("eagle", "mtp"):  # n-gram and draft-model drafts run
            raise ValueError(f"speculative decoding method {spec.method}: not supported with pipeline_parallel_size "
                             "> 1 yet (its head reads the target's hidden states, which the last stage holds)")


def engine_options(args: Any) -> dict:
    """EngineConfig keywords from the parsed engine flags (pdserve.entrypoints.cli's --dtype, --block-size, ...)."""
    return dict(dtype=args.dtype, kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                kv_cache_memory_gb=args.kv_cache_memory_gb, kv_cache_prefault=prefault_default(args),
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs, kernel_backend=args.kernel_backend,
                cpu_gemm_dtype=getattr(args, "cpu_gemm_dtype", "auto"),
                enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
                enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
                speculative_config=getattr(args, "speculative_config", None),
                encoder_cache_tokens=getattr(args, "encoder_cache_tokens", 16384),
                max_model_len=getattr(args, "max_model_len", None),
                allow_long_max_model_len=getattr(args, "allow_long_max_model_len", False),
                **lora_options(args))


def prefault_default(args: Any) -> bool:
    """--kv-cache-prefault where given; else on where the pool's size was given (the operator
    reserved that memory, as vLLM's VLLM_CPU_KVCACHE_SPACE does), and off for the default pool: a
    share of the machine's memory, split among the nodes on it, which it would hold from the start
    on every node of `docker compose up` whether used or not."""
    given = getattr(args, "kv_cache_prefault", None)
    if given is not None:
        return given
    return args.num_kv_blocks is not None or args.kv_cache_memory_gb is not None


def lora_options(args: Any) -> dict:
    """EngineConfig's LoRA keywords from --lora-modules name=DIR ..., --max-loras, --max-lora-rank
    and --max-cpu-loras (absent flags: adapters off)."""
    modules = dict(getattr(args, "lora_modules", None) or [])
    return dict(enable_lora=bool(modules) or getattr(args, "enable_lora", False), lora_modules=modules or None,
                max_loras=getattr(args, "max_loras", 1), max_lora_rank=getattr(args, "max_lora_rank", 16),
                max_cpu_loras=getattr(args, "max_cpu_loras", None))


def lora_flags(args, router: bool = False) -> list[str]:
    """The LoRA flags `pdserve up` passes on: --lora-modules (as absolute paths) to the router and
    the nodes, the slot settings to the nodes."""
    modules = getattr(args, "lora_modules", None) or []
    flags = ["--lora-modules", *(f"{name}={os.path.abspath(path)}" for name, path in modules)] if modules else []
    if router:
        return flags
    if getattr(args, "enable_lora", False):
        flags.append("--enable-lora")
    flags += ["--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank)]
    return flags + (["--max-cpu-loras", str(args.max_cpu_loras)] if args.max_cpu_loras is not None else [])
