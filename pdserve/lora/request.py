"""The offline API's handle on an adapter, shaped as vLLM's LoRARequest(lora_name, lora_int_id,
lora_path)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if self.lora_int_id < 1:  # as vLLM: 0 would mean "no adapter"
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
