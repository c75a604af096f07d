"""The tensor-parallel executor: the node process (the driver, rank 0) and its worker processes
(ranks 1..N-1), each holding one shard of the weights and writing its KV heads' slice of one
shared paged cache. See docs/tensor-parallelism.md."""
