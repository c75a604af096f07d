"""pdserve beside other servers of the same model: llama.cpp's llama-server and `transformers serve`."""
