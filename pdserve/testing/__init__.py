"""Fixtures that the tests and the benchmarks share: throwaway redis-servers and Redis Clusters, a
`pdserve up` cluster in its own processes, random-weight checkpoints written with transformers,
and SmolLM2 as transformers loads it. Nothing in the serving code imports this package."""
