"""What the benchmarks share: starting a `pdserve up` cluster or a peer server, and the ~32M bench model."""
