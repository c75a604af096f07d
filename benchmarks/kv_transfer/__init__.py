"""Moving KV blocks: NIXL transfers, the LMCache store and its tiers, and the bytes a layout holds."""
