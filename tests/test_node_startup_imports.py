"""What a node process imports before it serves is start-up time, paid by every node of every
cluster (docs/testing.md, "Where the time goes"): the router's HTTP stack is not among it, nor
redis-py for a node without a store."""
from __future__ import annotations

import subprocess
import sys

from pdserve.models.builtin import ensure_builtin_model
from pdserve.models.loader import load_hf_config

# A node's path: `python -m pdserve prefill|decode ...` builds the whole flag parser, then loads
# the node's modules. FastAPI, Starlette and uvicorn are the router's alone; redis-py (0.1 s of
# CPU) is imported only by a node given a store (--store), when it builds it.
NODE_IMPORTS = """
import sys
from pdserve.entrypoints.cli import build_parser
build_parser().parse_args(["prefill", "--node-id", "p", "--bind", "tcp://127.0.0.1:1"])
import pdserve.node.main, pdserve.node.prefill, pdserve.node.decode, pdserve.assembly.build
print(",".join(sorted({m.split(".")[0] for m in sys.modules} & {"fastapi", "starlette", "uvicorn", "redis"})))
"""


def test_a_node_process_never_loads_the_router_http_stack_nor_redis_without_a_store():
    out = subprocess.run([sys.executable, "-c", NODE_IMPORTS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "", f"a node process imports {out.stdout.strip()}"


# A node's engine, built the way a node builds it, from a model whose config an earlier process
# resolved: transformers' config classes (about 1 s of CPU, pdserve.models.config_snapshot) and
# sympy (about 0.4 s, which Module.to_empty's Python reference imports) stay out of the process.
ENGINE_IMPORTS = """
import sys
from pdserve import LLM
LLM("builtin:tiny", kv_cache_memory_gb=0.1)
heavy = {"transformers.configuration_utils", "transformers.models.auto.configuration_auto",
         "transformers.activations", "sympy", "torch.fx.experimental.symbolic_shapes"}
print(",".join(sorted(heavy & set(sys.modules))))
"""


def test_a_node_engine_loads_a_known_config_without_transformers_config_classes_or_sympy():
    load_hf_config(ensure_builtin_model("builtin:tiny"))  # resolved once: what the node then reads back
    out = subprocess.run([sys.executable, "-c", ENGINE_IMPORTS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "", f"a node's engine imports {out.stdout.strip()}"
