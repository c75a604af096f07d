"""The load generator behind `pdserve bench`: requests, latency statistics (bench.py), its
command line (cli.py) and latency plots (plot.py)."""
