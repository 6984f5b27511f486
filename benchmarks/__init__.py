"""Benchmarks: measured numbers for the claims the design makes about speed."""
