"""What `conveyor run` says when the user's code or its shutdown goes wrong: real runner processes.

A module that raises at import shows its own traceback (file and line); a
file path gets the dotted name to type; handlers that outrun
``--graceful-timeout`` are reported, their messages given back, and the
runner exits 3 instead of claiming it stopped cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conveyor import Producer, Subscription
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parents[2]


def write_app(root: Path, name: str, source: str) -> None:
    package = root / "app"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").touch()
    (package / f"{name}.py").write_text(textwrap.dedent(source))


def run(cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "conveyor", "run", *args, "--metrics-port", "-1", "--broker", "tcp://127.0.0.1:1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_a_module_that_raises_at_import_shows_its_own_traceback(tmp_path):
    write_app(
        tmp_path,
        "handlers",
        """\
        from conveyor import consumer

        SETTINGS = {}
        TIMEOUT = SETTINGS["timeout"]
        """,
    )
    result = run(tmp_path, "app.handlers")
    assert result.returncode == 2, result
    handlers = str(tmp_path / "app" / "handlers.py")
    assert f'File "{handlers}", line 4, in <module>' in result.stderr, result.stderr
    assert 'TIMEOUT = SETTINGS["timeout"]' in result.stderr, result.stderr
    assert "KeyError: 'timeout'" in result.stderr, result.stderr
    assert "importlib" not in result.stderr, "the import machinery's frames are noise"


def test_a_missing_dependency_of_the_module_is_not_called_a_missing_module(tmp_path):
    write_app(tmp_path, "deps", "import conveyor_no_such_dependency\n")
    result = run(tmp_path, "app.deps")
    assert result.returncode == 2, result
    assert "No module named 'conveyor_no_such_dependency'" in result.stderr, result.stderr
    assert f'File "{tmp_path / "app" / "deps.py"}", line 1' in result.stderr, result.stderr


def test_a_retry_count_the_wire_cannot_carry_stops_the_runner_at_import(conveyor_broker, tmp_path):
    """Refused where it is written, not later as an INVALID_REQUEST to the SUBSCRIBE."""
    write_app(
        tmp_path,
        "counts",
        """\
        import tenacity
        from conveyor import consumer, retry_policy

        @consumer("counts", group="g")
        @retry_policy(stop=tenacity.stop_after_attempt(2**40))
        def handle(message):
            pass
        """,
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "conveyor",
        "run",
        "app.counts",
        "--metrics-port",
        "-1",
        "--broker",
        conveyor_broker.address,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert result.returncode == 2, result
    assert "stop_after_attempt takes an int from 1 to 2147483647, not 1099511627776" in result.stderr, result.stderr
    assert f'File "{tmp_path / "app" / "counts.py"}", line 5' in result.stderr, result.stderr
    assert "INVALID_REQUEST" not in result.stderr, result.stderr


def test_a_file_path_gets_the_dotted_name(tmp_path):
    write_app(tmp_path, "handlers", "raise SystemExit('a path must not be imported')\n")
    for spec, dotted in (
        ("app/handlers.py", "conveyor run app.handlers"),
        ("./app/handlers.py:bill", "conveyor run app.handlers:bill"),
        ("app.handlers.py", "conveyor run app.handlers"),
    ):
        result = run(tmp_path, spec)
        assert result.returncode == 2, result
        assert "[CONFIG_ERROR]" in result.stderr and dotted in result.stderr, result.stderr
        assert "Traceback" not in result.stderr, result.stderr


SLOW_HANDLERS = {
    "sync": "def slow(message):\n    pathlib.Path(STARTED).touch()\n    time.sleep(600)\n",
    "async": "async def slow(message):\n    pathlib.Path(STARTED).touch()\n    await asyncio.sleep(600)\n",
}


@pytest.mark.parametrize("kind", sorted(SLOW_HANDLERS))
def test_handlers_that_outrun_the_graceful_timeout_are_given_back_and_exit_3(conveyor_broker, tmp_path, kind):
    started = tmp_path / "started"
    topic = f"slow-{kind}"
    source = "import asyncio\nimport pathlib\nimport time\n\nfrom conveyor import consumer\n\n"
    source += f"STARTED = {str(started)!r}\n\n\n"
    source += f"@consumer({topic!r}, group='slow', concurrency=1)\n" + SLOW_HANDLERS[kind]
    write_app(tmp_path, "slow", source)
    with Producer(conveyor_broker.address, linger_ms=1) as producer:
        producer.send_many(topic, [b"a", b"b", b"c", b"d", b"e"])
        producer.flush(timeout=30)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "conveyor", "run", "app.slow", "--broker", conveyor_broker.address]
    cmd += ["--metrics-port", "-1", "--graceful-timeout", "1"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(started.exists, timeout=30), "the handler never started"
        proc.terminate()
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 3, output
    assert "5 message(s) given back for redelivery" in output, output
    assert "stopped cleanly" not in output, output
    assert "Traceback" not in output and "Task was destroyed" not in output, output
    sub = Subscription(topic, "slow", address=conveyor_broker.address)
    try:
        got: list = []
        deadline = time.monotonic() + 30
        while len(got) < 5 and time.monotonic() < deadline:
            got += sub.receive(timeout=0.2)
        assert sorted(m.value for m in got) == [b"a", b"b", b"c", b"d", b"e"], "given back, not lost"
    finally:
        sub.close()
