"""``conveyor bench``: scenarios from JSON, Conveyor and its peers side by side, an HTML report.

Every party is its own process: the broker (or a peer's server), each producer
and each consumer. See ``benchmarks/README.md`` ("The benchmark suite").
"""
