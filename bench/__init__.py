"""Benchmarks. Each prints ratios against a baseline measured in the same run (this machine is noisy)."""
