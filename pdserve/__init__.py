"""pdserve: disaggregated prefill/decode LLM serving."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig"]


def __getattr__(name: str):
    # Lazy, so `import pdserve.router` and the CLI do not pay for torch and the model code.
    if name == "LLM":
        from pdserve.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from pdserve.engine.sampling_params import SamplingParams
        return SamplingParams
    if name == "EngineConfig":
        from pdserve.engine.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
