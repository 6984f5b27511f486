"""Example jobs, each runnable with ``spark-submit pipeline/jobs/<name>.py`` or
``python -m conveyor.pipeline.jobs.<name>``.

* ``archive``: a topic to date-partitioned Parquet, exactly-once and resumable (streaming checkpoint).
* ``ingest``: CSV / JSON / Parquet files or a SQLite table to a topic, with a progress line.
* ``lag_report``: per-group lag and throughput over time, from the broker's admin API, into a table.
"""
