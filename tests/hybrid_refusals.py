"""The hybrid-model section of docs/feature-matrix.md, built from the refusals themselves: what
`unsupported_for_hybrid` says for each feature an engine config can turn on.
tests/test_feature_matrix.py appends it to the page it writes; tests/test_models_hybrid.py checks
the engine refuses each with that message."""
from __future__ import annotations

from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.models.hybrid import unsupported_for_hybrid
from pdserve.models.tp_shard_hybrid import HYBRID_TP_FAMILIES

DOC = Path(__file__).resolve().parent.parent / "docs" / "feature-matrix.md"
# feature -> the engine settings that turn it on
FEATURES = {
    "speculation": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
    "LoRA": dict(enable_lora=True),
    "TP 2": dict(tensor_parallel_size=2),
    "PP 2": dict(pipeline_parallel_size=2),
}


def refusal(feature: str, architecture: str = "Qwen3_5ForCausalLM") -> str:
    config = EngineConfig(**FEATURES[feature])
    (reason,) = unsupported_for_hybrid(config, architecture, HYBRID_TP_FAMILIES)
    return reason


def refused(feature: str, architecture: str) -> bool:
    """Whether the feature is refused for this architecture (TP splits some hybrids)."""
    return bool(unsupported_for_hybrid(EngineConfig(**FEATURES[feature]), architecture, HYBRID_TP_FAMILIES))


def hybrid_section() -> str:
    lines = ["## Hybrid models", "",
             "Qwen3.5 (text, and with images), Qwen3-Next, Nemotron-H, Granite 4.0-H and Falcon-H1 ([models](models.md#hybrid-models-qwen35-nemotron-h)) keep a recurrent state per "
             "request beside the KV blocks. `tests/test_models_hybrid.py` checks each refusal below at start; "
             "offline greedy decoding, chunked prefill, batched decode, preemption and prefix caching (with "
             "the state snapshotted at block boundaries) match transformers; so does P/D over NIXL and through the "
             "store, the state handed over with the blocks (`tests/test_hybrid_pd.py`). Every one splits "
             "over tensor-parallel ranks (Qwen3.5 with images: its language model, the tower on rank 0), and "
             "P/D hands over between nodes at different degrees (`tests/test_hybrid_tp.py`, "
             "`tests/test_qwen3_5_vl_engine.py`).", "",
             "| feature | hybrid model |", "|---|---|"]
    lines += ["| prefix caching | ✓ (the state snapshotted at block boundaries; across nodes through the store) |",
              "| P/D handover | ✓ (the state travels with the blocks, over NIXL and through the store) |"]
    lines += [f"| {name} | ✗ |" for name in FEATURES if name != "TP 2"]
    lines += ["| TP 2 | ✓ (each rank's heads; the state pool whole and shared, so the handover is the same at "
              "every degree) |", ""]
    lines += [f"- **{name}:** {refusal(name)}" for name in FEATURES if name != "TP 2"]
    return "\n".join(lines) + "\n"
