"""``conveyor bench --py-spy DIR``: the summary of each process's raw stacks."""

from __future__ import annotations

from conveyor.benchmarks.cli import _write_profile_summary


def test_the_summary_covers_each_profiled_process_and_not_an_earlier_summary(tmp_path):
    (tmp_path / "run-0-broker.txt").write_text("main (a.py:1);loop (a.py:2) 30\nmain (a.py:1);poll (a.py:3) 10\n")
    (tmp_path / "run-0-producer1.txt").write_text("send (b.py:1) 5\n")
    (tmp_path / "summary.txt").write_text("left by an earlier run into the same directory\n")

    _write_profile_summary(tmp_path)
    _write_profile_summary(tmp_path)  # again into the same directory: the same summary

    text = (tmp_path / "summary.txt").read_text()
    assert text.count(" samples") == 2
    assert "run-0-broker.txt: 40 samples" in text and "run-0-producer1.txt: 5 samples" in text
    assert "summary.txt" not in text
