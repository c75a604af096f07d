"""pdserve: disaggregated prefill/decode LLM serving."""
from __future__ import annotations


def _version() -> str:
    """The installed distribution's version; from a source tree that was never installed, pyproject's."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pdserve")
    except PackageNotFoundError:
        import re
        from pathlib import Path
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) if pyproject.exists() else None
        return found.group(1) if found else "unknown"


__version__ = _version()
__all__ = ["LLM", "SamplingParams", "EngineConfig", "LoRARequest"]


def __getattr__(name: str):
    # Lazy, so `import pdserve.router` and the CLI do not pay for torch and the model code.
    if name == "LLM":
        from pdserve.offline.llm import LLM
        return LLM
    if name == "SamplingParams":
        from pdserve.protocol.sampling_params import SamplingParams
        return SamplingParams
    if name == "EngineConfig":
        from pdserve.engine.config import EngineConfig
        return EngineConfig
    if name == "LoRARequest":
        from pdserve.lora.request import LoRARequest
        return LoRARequest
    raise AttributeError(name)
