"""Which node roles serve a hybrid model (linear-attention or Mamba layers, whose per-request
recurrent state lives in the engine's state pool, pdserve.engine.state_pool).

A hybrid model's state is not handed over between nodes yet: neither NIXL nor the store carries
it, and the compatibility handshake does not describe it. Until it is, such a model runs whole
on decode nodes (`pdserve up --prefill-nodes 0`); a prefill (or encoder) node is refused when it
starts. A decode node keeps its transport flags (`pdserve up` gives every node both roles'), but
its engine never takes KV from elsewhere for such a model: it computes every prompt itself
(LLMEngine.add_request), so no handover is pulled.
"""
from __future__ import annotations


def check_hybrid_role(role: str, engine) -> None:
    """ValueError when a hybrid model's node would hand its state over; nothing for other models."""
    if engine.kv.states is None or role == "decode":
        return
    arch = engine.hf_config.architectures[0]
    raise ValueError(f"{arch} is a hybrid model: its recurrent state is not handed over between nodes yet, so it "
                     f"cannot run on a {role} node; serve it whole on decode nodes (pdserve up --prefill-nodes 0)")
