"""What a node process imports before it serves is start-up time, paid by every node of every
cluster (docs/testing.md, "Where the time goes"): the router's HTTP stack is not among it."""
from __future__ import annotations

import subprocess
import sys

# A node's path: `python -m pdserve prefill|decode ...` builds the whole flag parser, then loads
# the node's modules. FastAPI, Starlette and uvicorn are the router's alone.
NODE_IMPORTS = """
import sys
from pdserve.entrypoints.cli import build_parser
build_parser().parse_args(["prefill", "--node-id", "p", "--bind", "tcp://127.0.0.1:1"])
import pdserve.node.main, pdserve.node.prefill, pdserve.node.decode, pdserve.assembly.build
print(",".join(sorted({m.split(".")[0] for m in sys.modules} & {"fastapi", "starlette", "uvicorn"})))
"""


def test_a_node_process_never_loads_the_router_http_stack():
    out = subprocess.run([sys.executable, "-c", NODE_IMPORTS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "", f"a node process imports {out.stdout.strip()}"
