"""The protocol floor: the plain types every layer shares, with no torch.

Sampling parameters and outputs, block keys and the cache salt, the TPOT budget and the
structured-output grammar checks. The router, the wire messages and the stores import these;
nothing here imports another pdserve package, so the router process stays free of torch.
"""
