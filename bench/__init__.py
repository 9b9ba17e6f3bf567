"""gpupool benchmarks: programs that print tables and write JSON to bench/results/; never tests."""
