"""Serving benchmark CLI: the same as `pdserve bench` (pdserve.loadgen.cli).

    python -m benchmarks.serving.serve_bench --base-url http://127.0.0.1:8000 --workload shared-prefix \
        --num-groups 4 --prompts-per-group 16 --prefix-len 1024 --concurrency 8
"""
from __future__ import annotations

import sys

from pdserve.loadgen.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
