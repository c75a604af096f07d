"""A GGUF file's quantization scheme: which layers keep their blocks quantized, and how.

Each tensor of a GGUF carries its own type. A linear layer (or the embedding / LM head) keeps
its weights quantized when every checkpoint part it fuses (q, k, v; gate, up) is of a type that
gguf_blocks decodes; the layer then holds the smallest GroupFormat that holds each part exactly.
Any other type is dequantized to float32 at load, with one log line per type saying so.
"""
from __future__ import annotations

import logging

from torch import nn

from pdserve.layers.quant.base import QuantConfig, QuantMethod
from pdserve.layers.quant.gguf_blocks import KEPT_TYPES
from pdserve.layers.quant.grouped import FUSED_PARTS, GroupedLinearMethod, GroupFormat, common_format
from pdserve.layers.quant.unquantized import UnquantizedLinearMethod

log = logging.getLogger("pdserve.quant")

# The native format of each kept type (see gguf_blocks' table).
NATIVE_FORMATS = {
    "Q4_0": GroupFormat(4, 32, True, True), "Q4_1": GroupFormat(4, 32, True, True),
    "Q8_0": GroupFormat(8, 32, True, False), "Q4_K": GroupFormat(4, 32, False, True),
    "Q5_K": GroupFormat(8, 32, False, True), "Q6_K": GroupFormat(8, 16, False, False),
}
_FLOAT_TYPES = ("F32", "F16", "BF16")


class GGUFQuantConfig(QuantConfig):
    name = "gguf"

    def __init__(self, tensor_types: dict[str, str]):
        """tensor_types: Hugging Face weight name without 'model.' (layers.0.self_attn.q_proj.weight)
        -> GGUF type name (Q4_1, F32, ...)."""
        self.tensor_types = tensor_types
        self.kept: set[str] = set()  # the weight names loaded quantized, filled as layers are built
        self._log_dequantized()

    def _log_dequantized(self) -> None:
        counts: dict[str, int] = {}
        for name, kind in self.tensor_types.items():
            if kind not in KEPT_TYPES and kind not in _FLOAT_TYPES and name.endswith(".weight"):
                counts[kind] = counts.get(kind, 0) + 1
        for kind, n in sorted(counts.items()):
            log.warning("GGUF type %s has no quantized kernel in pdserve: %d tensors dequantized to float "
                        "at load (kept quantized: %s)", kind, n, ", ".join(KEPT_TYPES))

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        head, _, last = prefix.rpartition(".")
        parts = [f"{head}.{p}.weight" if head else f"{p}.weight" for p in FUSED_PARTS.get(last, (last,))]
        if prefix == "lm_head" and "lm_head.weight" not in self.tensor_types:
            parts = ["embed_tokens.weight"]  # tied: the LM head is the embedding
        kinds = [self.tensor_types.get(p) for p in parts]
        if not all(k in NATIVE_FORMATS for k in kinds):
            return UnquantizedLinearMethod()
        self.kept.update(parts)
        return GroupedLinearMethod(common_format([NATIVE_FORMATS[k] for k in kinds]))
