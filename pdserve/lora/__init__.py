"""LoRA adapters served beside their base model: PEFT-format adapters read from disk
(peft_format), per-layer slot buffers that add the low-rank products of a step's adapters to the
base layers' outputs (slots), and the manager that keeps the registered adapters, their CPU
copies and the resident slots, evicting least recently used (manager)."""
from pdserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
