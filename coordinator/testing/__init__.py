"""Harnesses for the tests, the benchmarks and the fault harness (chaos/); ``serve`` never imports them."""
