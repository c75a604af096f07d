"""Model building blocks shared by every family: linear layers that know their tensor-parallel
shard and their quantization method (linear.py, quant/), the vocabulary-parallel embedding and
LM head (vocab.py), and the tensor-parallel group they communicate through (parallel.py)."""
