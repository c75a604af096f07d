"""The router's HTTP app: its routes (OpenAI, models, tokenize, embeddings, LoRA, admin) and
the admission middleware, over the OpenAI shapes in router.openai."""
