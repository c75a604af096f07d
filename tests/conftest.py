import os

import torch

# Triton reads TRITON_INTERPRET when it is imported, so this must run before any test module
# imports it: without a GPU the Triton kernels run on the CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
