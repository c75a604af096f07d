"""A node process: the runtime every role shares, which owns the engine, control socket and KV
events (runtime.py); the two roles, prefill.py and decode.py; where a handover is made, one
producer per transport (producers.py), and where it is pulled, one puller per handover type
(pullers.py); the process entry point (main.py) and the queue of embedding requests
(embeddings.py)."""
