"""pdserve: disaggregated prefill/decode LLM serving."""
from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def _version() -> str:
    """The installed distribution's version; from a source tree that was never installed, pyproject's."""
    try:
        return version("pdserve")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) if pyproject.exists() else None
        return found.group(1) if found else "unknown"


__version__ = _version()
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "EngineConfig", "LoRARequest"]


def __getattr__(name: str):
    # Lazy, so `import pdserve.router` and the CLI do not pay for torch and the model code: each
    # import below is deferred to the name's first use, and its `if` line says what it would pull in.
    if name == "LLM":  # torch, the engine and the model code
        from pdserve.offline.llm import LLM
        return LLM
    if name == "SamplingParams":  # the protocol package, light, kept lazy like the rest
        from pdserve.protocol.sampling_params import SamplingParams
        return SamplingParams
    if name == "BeamSearchParams":  # the protocol package, light, kept lazy like the rest
        from pdserve.protocol.beam_search import BeamSearchParams
        return BeamSearchParams
    if name == "EngineConfig":  # the engine's configuration and what it validates against
        from pdserve.engine.config import EngineConfig
        return EngineConfig
    if name == "LoRARequest":  # the lora package, light, kept lazy like the rest
        from pdserve.lora.request import LoRARequest
        return LoRARequest
    raise AttributeError(name)
