import json
import os
from pathlib import Path

# OpenMP threads (torch's and the numba kernels', one libgomp) that finish a parallel region spin
# before they sleep: by default 300,000 pause instructions, milliseconds each time on this CPU.
# The suite runs two workers and their clusters on 2 cores, so a spinning thread takes the core
# from work that is ready. 1,000 spins is libgomp's own count for a machine with more threads than
# cores. Read when libgomp loads (torch's import), so set before it, here and for every process
# the suite starts (inherited). One offline generate beside another process, three alternated
# runs each: 44.5, 14.7, 11.4 s of CPU spinning as by default, 12.2, 11.4, 11.6 s at 1,000.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import pytest
import torch

from pdserve.kernels import dequant_tiles
from pdserve.testing.private_cache import private_cache_dir
from pdserve.testing.shared_clusters import SharedClusters, file_seconds, group_map, longest_first
from pdserve.wire.transport import PORT_RANGE_ENV, port_range

# Triton reads TRITON_INTERPRET when it is imported, so this must run before any test module
# imports it: without a GPU the Triton kernels run on the CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# cpu_gemm_dtype auto (the default) is bf16 products on a CPU that has them. The suite compares
# greedy output with float32 references (transformers, the offline engine), so auto means float32
# here, in this process and every node it starts; the bf16 products are tested where a test asks
# for them (test_gemm_dtype) and auto's choice in test_gemm_dtype too.
os.environ.setdefault("PDSERVE_CPU_GEMM_DTYPE", "float32")


@pytest.fixture(autouse=True)
def _products_dtype_restored():
    """Building an engine sets this process's product dtype (dequant_tiles.set_tile_dtype): a test
    that builds one in bf16 or int8 must not leave the next test on an xdist worker running its
    float32 kernels in bf16 (stop 82's failure in test_kernels)."""
    before = dequant_tiles.gemm_dtype()
    yield
    if dequant_tiles.gemm_dtype() != before:
        dequant_tiles.set_tile_dtype(before)


# ---- pytest-xdist workers (`-n`, docs/testing.md) -------------------------------------------------
# Each worker draws its ports from its own slice of free_port's range, and so does every process it
# starts (the variable is inherited): clusters on two workers never draw the same port.
if "PYTEST_XDIST_WORKER" in os.environ:
    _index, _count = int(os.environ["PYTEST_XDIST_WORKER"][2:]), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    _lo, _hi = port_range()
    _step = (_hi - _lo) // _count
    os.environ[PORT_RANGE_ENV] = f"{_lo + _index * _step}-{_lo + (_index + 1) * _step}"

FILE_SECONDS = Path(__file__).with_name("file_seconds.json")  # a whole run's seconds per file
FILE_SECONDS_OUT_ENV = "PDSERVE_FILE_SECONDS_OUT"  # where this run writes its own, where set
WORKERS_ENV = "PDSERVE_TEST_WORKERS"  # what `-n auto` means; 2 by default (see pytest_xdist_auto_num_workers)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: two workers, or $PDSERVE_TEST_WORKERS. Two on the 2-core CI machine cut the run by
    about a quarter (a cluster's start waits on sockets and processes; the other worker fills the
    gap). More are untried: each worker's clusters hold their own memory and cores."""
    return int(os.environ.get(WORKERS_ENV, "2"))


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """PDSERVE_CACHE_DIR in the test's own directory, sharing the compiled kernels (see
    pdserve.testing.private_cache)."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(private_cache_dir(tmp_path)))


# ---- clusters that several modules share (pdserve.testing.shared_clusters, docs/testing.md) ---
_shared = SharedClusters(("plain_cluster", "store_cluster", "default_model_cluster"))


@pytest.fixture(scope="module")
def plain_cluster():
    """The built-in test model, one prefill and one decode node, KV over NIXL (running_cluster's
    test defaults): test_bench_plot, test_dashboard, test_detokenize, test_no_server_errors,
    test_openapi_fuzz and test_penalties (over NIXL) send it requests and change nothing else in it."""
    return _shared.url("plain_cluster", "--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "nixl")


@pytest.fixture(scope="module")
def store_cluster():
    """plain_cluster's, with the KV through the store (pdserve up's own redis-server):
    test_penalties (its store half) and test_trace_replay send it requests and change nothing
    else in it."""
    return _shared.url("store_cluster", "--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "store")


@pytest.fixture(scope="module")
def default_model_cluster(request):
    """`pdserve up` with no flags but its port: the default model (SmolLM2), one prefill and one
    decode node, KV over NIXL. test_agents_sdk, test_default_model_tools, test_responses_api,
    test_smollm2 and test_tool_call_tags share it. The module that starts it gives its start-up timeout (START_TIMEOUT_S)."""
    timeout_s = getattr(request.module, "START_TIMEOUT_S", 240.0)
    return _shared.url("default_model_cluster", as_given=True, timeout_s=timeout_s)


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        from pdserve.testing.xdist_groups import share_groups_file  # pytest-xdist: only under -n

        share_groups_file()


def pytest_xdist_make_scheduler(config, log):
    """Under `-n` (`--dist loadgroup`, pyproject's addopts): whole groups to a worker
    (pdserve.testing.xdist_groups), in collection order. Another --dist keeps xdist's own."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from pdserve.testing.xdist_groups import GroupScheduling  # pytest-xdist: only under -n

    return GroupScheduling(config, log)


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: count only the tests that will run
def pytest_collection_modifyitems(items):
    items[:] = longest_first(items, _shared.names, file_seconds(FILE_SECONDS))
    _shared.count_users(items)
    if "PYTEST_XDIST_WORKER" in os.environ:
        from pdserve.testing.xdist_groups import write_groups  # pytest-xdist: only under -n

        write_groups(group_map(items, _shared.names))


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item):
    _shared.finished(item)


def pytest_sessionfinish():
    _shared.stop_all()  # a run stopped early (-x, Ctrl-C) leaves none running


# ---- the suite's time per file, printed at the end of the run (docs/testing.md) -------------
_seconds_per_file: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Setup, call and teardown of each test, summed per file: a module-scoped cluster's start
    lands in its first test's setup and its stop in its last test's teardown."""
    path = report.nodeid.split("::", 1)[0]
    _seconds_per_file[path] = _seconds_per_file.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _seconds_per_file:
        return
    total = sum(_seconds_per_file.values())
    terminalreporter.section("seconds per test file (setup + call + teardown)")
    for path, seconds in sorted(_seconds_per_file.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:9.1f} s  {100 * seconds / total:5.1f}%  {path}")
    terminalreporter.write_line(f"{total:9.1f} s  in {len(_seconds_per_file)} files")
    if out := os.environ.get(FILE_SECONDS_OUT_ENV):  # a whole run's, to refresh FILE_SECONDS with
        Path(out).write_text(json.dumps({p: round(s, 1) for p, s in sorted(_seconds_per_file.items())}, indent=0) + "\n")
