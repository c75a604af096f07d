"""Putting an engine together, above the packages it joins: the engine core (pdserve.engine),
the tensor-parallel executor (pdserve.executor) and speculative decoding (pdserve.spec_decode).
build.build_engine(config) is the one way to make an LLMEngine; the offline LLM
(pdserve.offline.llm) and the nodes (pdserve.node.main) call it."""
