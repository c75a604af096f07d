"""`pdserve bench --sweep-concurrency ... --plot`: against a real `pdserve up` cluster, one report
per level with the level's concurrency, a table built from those reports, a JSON that
--plot-with reads back, and a PNG of the expected shape."""
from __future__ import annotations

import json

import matplotlib.image
import pytest

from cluster_util import running_cluster
from pdserve import bench_plot
from pdserve.bench import main as bench_main

WORKLOAD = ["--workload", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "3", "--prefix-len", "64",
            "--question-len", "8", "--output-len", "6", "--max-token-id", "250", "--num-warmup", "0",
            "--disable-tqdm"]


@pytest.fixture(scope="module")
def url():
    with running_cluster("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "nixl") as (url, _):
        yield url


def test_sweep_writes_reports_table_and_plot(url, tmp_path, capsys):
    out, png = tmp_path / "pd.json", tmp_path / "pd.png"
    assert bench_main(["--base-url", url, *WORKLOAD, "--sweep-concurrency", "1,3", "--label", "pd",
                       "--output-json", str(out), "--plot", str(png)]) == 0
    label, reports = bench_plot.load_series(str(out))
    assert label == "pd" and [r["config"]["concurrency"] for r in reports] == [1, 3]
    for r in reports:
        assert r["completed"] == 6 and r["failed"] == 0
        samples = r["samples_s"]
        assert len(samples["ttft"]) == len(samples["e2e"]) == 6 and samples["itl"]
        ttfts = sorted(t * 1000 for t in samples["ttft"])
        assert ttfts[-2] - 1e-6 <= r["p99_ttft_ms"] <= ttfts[-1] + 1e-6  # the report's p99 is of these samples
    table = capsys.readouterr().out
    for r in reports:  # each table row is its report's numbers
        assert f"| {r['config']['concurrency']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} |" in table
    image = matplotlib.image.imread(png)
    assert image.shape[1] == 20 * 110 and image.shape[0] == int(4.5 * 110)  # four panels: CDFs + sweep


def test_plot_with_an_earlier_run_and_single_run_cdfs(url, tmp_path):
    earlier = tmp_path / "earlier.json"
    assert bench_main(["--base-url", url, *WORKLOAD, "--concurrency", "2", "--label", "earlier",
                       "--output-json", str(earlier), "--plot", str(tmp_path / "one.png")]) == 0
    image = matplotlib.image.imread(tmp_path / "one.png")
    assert image.shape[1] == 15 * 110  # three CDF panels, no sweep
    assert json.loads(earlier.read_text())["runs"][0]["config"]["concurrency"] == 2
    png = tmp_path / "both.png"
    assert bench_main(["--base-url", url, *WORKLOAD, "--sweep-concurrency", "1,2", "--label", "now",
                       "--plot", str(png), "--plot-with", str(earlier)]) == 0
    assert matplotlib.image.imread(png).shape[1] == 20 * 110


def test_sweep_table_from_synthetic_reports():
    reports = [{"config": {"concurrency": c}, "request_throughput": 2.0 * c, "output_throughput": 10.0 * c,
                "p50_ttft_ms": 5.0, "p99_ttft_ms": None, "p99_e2e_ms": 50.0, "failed": 0} for c in (1, 4)]
    table = bench_plot.sweep_table(reports).splitlines()
    assert table[2] == "| 1 | 2.00 | 10.0 | 5 | - | 50 | 0 |"
    assert table[3] == "| 4 | 8.00 | 40.0 | 5 | - | 50 | 0 |"
