"""A local Spark session tuned for tests, benchmarks and jobs run with ``python -m``.

Under ``spark-submit`` the jobs use the session spark-submit configured;
on a laptop or in CI they call ``local_session()``, which fixes the things
that otherwise trip a local PySpark 4: workers running another Python,
an odd hostname, the UI port, 200 shuffle partitions for a few MB.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from conveyor import pipeline

__all__ = ["get_session", "local_session", "under_spark_submit"]

CDS_DIR = Path(os.environ.get("CONVEYOR_SPARK_CDS_DIR", Path.home() / ".cache" / "conveyor-spark"))


def _cds_options() -> str:
    """JVM options for a class-data-sharing archive of Spark's classes (JDK 13+).

    The first session dumps the archive when its JVM exits (under a name of
    its own, so two first sessions never write one file); a later session
    adopts a finished dump and starts several seconds faster. A stale or
    broken archive is ignored by the JVM. ``CONVEYOR_SPARK_CDS=0`` turns this off.
    """
    if os.environ.get("CONVEYOR_SPARK_CDS", "1").lower() in ("0", "false", "no"):
        return ""
    import pyspark

    tag = hashlib.sha1(os.path.realpath(pyspark.__file__).encode()).hexdigest()[:10]
    quiet = "-Xlog:cds=off -Xlog:cds+dynamic=off"
    try:
        CDS_DIR.mkdir(parents=True, exist_ok=True)
        archive = CDS_DIR / f"spark-{pyspark.__version__}-{tag}.jsa"
        for dump in sorted(CDS_DIR.glob(f"{archive.stem}.*.jsa")):
            pid = int(dump.suffixes[-2].lstrip("."))
            stat = dump.stat()
            # The JVM writes the dump as it exits, after this Python process may be gone: wait until it is still.
            if _alive(pid) or time.time() - stat.st_mtime < 30:
                continue
            if not archive.exists() and stat.st_size > 0:
                dump.replace(archive)  # atomic: a finished dump becomes the archive
            else:
                dump.unlink()  # a second first session's dump: not needed
    except (OSError, ValueError):
        return ""
    if archive.exists():
        return f"-XX:SharedArchiveFile={archive} -Xshare:auto {quiet}"
    return f"-XX:ArchiveClassesAtExit={CDS_DIR / f'{archive.stem}.{os.getpid()}.jsa'} {quiet}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def local_session(
    app_name: str = "conveyor",
    *,
    master: str = "local[2]",
    shuffle_partitions: int = 4,
    conf: Mapping[str, Any] | None = None,
    class_data_sharing: bool = True,
) -> SparkSession:
    """A local session: loopback only, UI off, workers on this interpreter, ``conveyor`` registered."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.default.parallelism", str(shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.python.filterPushdown.enabled", "true")
        .config("spark.sql.streaming.stopTimeout", "30s")
        .config("spark.python.worker.reuse", "true")
    )
    cds = _cds_options() if class_data_sharing else ""
    if cds:
        builder = builder.config("spark.driver.extraJavaOptions", cds)
    for key, value in (conf or {}).items():
        builder = builder.config(key, str(value))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return pipeline.register(spark)


def under_spark_submit() -> bool:
    """True when this process was started by ``spark-submit`` (which runs the driver for us)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def get_session(app_name: str, master: str | None = None, conf: Mapping[str, Any] | None = None) -> SparkSession:
    """The session spark-submit made, or a local one (``master`` or ``local[*]``)."""
    if under_spark_submit() and master is None:
        builder = SparkSession.builder.appName(app_name)
        for key, value in (conf or {}).items():
            builder = builder.config(key, str(value))
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("WARN")  # keep the job's own progress lines readable
        return pipeline.register(spark)
    cores = os.cpu_count() or 2
    return local_session(app_name, master=master or "local[*]", shuffle_partitions=max(2, cores), conf=conf)
