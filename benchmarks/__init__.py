"""Benchmarks: measured numbers for the claims the design makes about speed."""

if __name__ != "conveyor.benchmarks":
    raise ImportError(f"import conveyor.benchmarks, not {__name__} (the repository's folders install under conveyor)")
