"""A rank's compute threads: set_rank_threads leaves torch and numba at the count asked.

numba's first set_num_threads starts its OpenMP pool, which sets the process's OpenMP thread
count (torch's, the same libgomp) to NUMBA_NUM_THREADS. A TP driver runs in the user's process,
whose NUMBA_NUM_THREADS is every core, so torch must be set after numba: the other way round its
idle OpenMP thread spun on the core of the worker rank, and the driver waited in every
all-reduce for the slowed worker. Each case runs in a fresh interpreter, where numba's pool has
not started yet, as in a driver."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHECK = """
import torch
from pdserve.kernels import numba_threads  # noqa: F401  (pdserve's OpenMP threading layer)
import numba
from pdserve.executor.group import set_rank_threads
torch.get_num_threads()  # the driver's setup.rank_threads reads it first: torch's threads are set up then
set_rank_threads({threads})
print(torch.get_num_threads(), numba.get_num_threads())
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_set_rank_threads_holds_after_numba_starts_its_pool(threads: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="3", NUMBA_NUM_THREADS="3")
    out = subprocess.run([sys.executable, "-c", CHECK.format(threads=threads)], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out == [str(threads), str(threads)]
