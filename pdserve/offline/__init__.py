"""The offline API: `LLM(model).generate(prompts, params)` over one in-process engine, as vLLM's.
Above the engine's builder (pdserve.assembly); the CLI's `pdserve generate` and the simulator's
cost calibration use it."""
