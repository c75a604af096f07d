"""What travels between routers and nodes: the typed msgspec messages, the zmq sockets that carry
them, and the CURVE keys that secure those sockets."""
