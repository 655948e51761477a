"""Benchmarks and the realistic workloads they share (not part of the installed package)."""
