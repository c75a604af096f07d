"""What every node process runs, whatever its role: the runtime that owns the engine, control
socket, KV events and handover (runtime.py), the process entry point (main.py) and the queue of
embedding requests (embeddings.py)."""
