"""`pdserve bench --sweep-concurrency ... --plot`: against a real `pdserve up` cluster, one report
per level with the level's concurrency, a table built from those reports, a JSON that
--plot-with reads back, and a PNG of the expected shape. On synthetic results: the table's
numbers are compute_metrics', the PNGs have the panels asked for, and `pdserve bench-plot`
redraws saved runs."""
from __future__ import annotations

import json
from dataclasses import asdict

import matplotlib.image
import pytest

from pdserve.entrypoints.cli import main as pdserve_main
from pdserve.loadgen import plot as bench_plot
from pdserve.loadgen.bench import BenchConfig, RequestResult
from pdserve.loadgen.cli import main as bench_main
from pdserve.loadgen.metrics import compute_metrics, latency_samples

WORKLOAD = ["--workload", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "3", "--prefix-len", "64",
            "--question-len", "8", "--output-len", "6", "--max-token-id", "250", "--num-warmup", "0",
            "--disable-tqdm"]


@pytest.fixture(scope="module")
def url(plain_cluster):
    """One prefill and one decode node over NIXL: conftest's cluster, shared with other modules."""
    return plain_cluster


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


def _synthetic_results(n: int, ttft_s: float) -> list[RequestResult]:
    """n requests of 10 output tokens, 20 ms apart after a TTFT that grows along the list."""
    return [RequestResult(success=True, prompt_tokens=100, output_tokens=10, ttft_s=ttft_s * (1 + i / n),
                          e2e_s=ttft_s * (1 + i / n) + 9 * 0.02, itls_s=[0.02] * 9) for i in range(n)]


def _synthetic_report(concurrency: int, results: list[RequestResult], duration_s: float) -> dict:
    cfg = BenchConfig(concurrency=concurrency)
    return {"config": asdict(cfg), **compute_metrics(results, duration_s, cfg), "samples_s": latency_samples(results)}


def test_sweep_table_rows_are_compute_metrics_numbers():
    reports = [_synthetic_report(c, _synthetic_results(8, 0.05 * c), 4.0 / c) for c in (1, 2, 4)]
    rows = bench_plot.sweep_table(reports).splitlines()[2:]
    assert len(rows) == 3
    for row, c in zip(rows, (1, 2, 4)):
        m = compute_metrics(_synthetic_results(8, 0.05 * c), 4.0 / c, BenchConfig())
        cells = [x.strip() for x in row.strip("|").split("|")]
        assert cells[0] == str(c)
        assert float(cells[1]) == pytest.approx(m["request_throughput"], abs=0.005)  # 8 requests / (4/c) s
        assert float(cells[2]) == pytest.approx(m["output_throughput"], abs=0.05) == 80 / (4.0 / c)
        assert [float(x) for x in cells[3:6]] == pytest.approx(
            [round(m["p50_ttft_ms"]), round(m["p99_ttft_ms"]), round(m["p99_e2e_ms"])], abs=0.5)


def test_plot_synthetic_cdfs_and_sweep_png(tmp_path):
    one = {"one run": [_synthetic_report(4, _synthetic_results(20, 0.1), 2.0)]}
    bench_plot.plot(one, str(tmp_path / "cdf.png"))
    image = matplotlib.image.imread(tmp_path / "cdf.png")
    assert image.shape[:2] == (int(4.5 * 110), 15 * 110)  # three CDF panels
    assert image[..., :3].std() > 0.05  # something was drawn, not a blank canvas
    sweep = {label: [_synthetic_report(c, _synthetic_results(20, scale * c), 4.0 / c) for c in (1, 2, 4, 8)]
             for label, scale in (("pd", 0.02), ("mono", 0.03))}
    path = tmp_path / "sweep.png"
    bench_plot.plot(sweep, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(path).shape[:2] == (int(4.5 * 110), 20 * 110)  # + throughput/TTFT panel


def test_bench_plot_command_redraws_saved_runs(tmp_path, capsys):
    for label in ("pd", "mono"):
        reports = [_synthetic_report(c, _synthetic_results(8, 0.05 * c), 2.0) for c in (1, 2)]
        bench_plot.save_series(str(tmp_path / f"{label}.json"), label, reports)
    out = tmp_path / "both.png"
    assert pdserve_main(["bench-plot", str(tmp_path / "pd.json"), str(tmp_path / "mono.json"), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pd:" in printed and "mono:" in printed and "| 2 | 4.00 | 40.0 |" in printed
    assert matplotlib.image.imread(out).shape[1] == 20 * 110
