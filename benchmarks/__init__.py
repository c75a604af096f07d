"""pdserve's benchmarks, each run from the repository root as a module: `python -m benchmarks.FOLDER.SCRIPT`."""
