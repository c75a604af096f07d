"""A node's side of the router's adapter routes: LoadLoRA / UnloadLoRA register and unregister
adapters on the node's engine (between steps: the node loop owns the engine), and the adapter
fields of its pongs, which the router routes by."""
from __future__ import annotations

import logging

from pdserve.engine.engine import LLMEngine
from pdserve.wire.messages import LoadLoRA, LoRAReply, UnloadLoRA

log = logging.getLogger(__name__)


def apply_lora_message(engine: LLMEngine, msg: LoadLoRA | UnloadLoRA) -> LoRAReply:
    try:
        if isinstance(msg, LoadLoRA):
            engine.add_lora(msg.lora_name, msg.lora_path)
            log.info("LoRA adapter %r loaded from %s", msg.lora_name, msg.lora_path)
            return LoRAReply(msg.seq, True)
        if not engine.remove_lora(msg.lora_name):
            return LoRAReply(msg.seq, False, f"LoRA adapter {msg.lora_name!r} is not loaded")
        log.info("LoRA adapter %r unloaded", msg.lora_name)
        return LoRAReply(msg.seq, True)
    except (ValueError, OSError) as exc:  # a bad directory or adapter: the router answers 400
        return LoRAReply(msg.seq, False, str(exc))


def lora_pong_fields(engine: LLMEngine) -> dict:
    """Pong's loras and active_loras (none when the engine serves no adapters)."""
    if engine.lora is None:
        return {}
    return {"loras": engine.lora.names(), "active_loras": engine.lora.resident(), "lora_enabled": True}
