"""The exit codes of every ``conveyor`` command, in one place (the README's table lists them)."""

from __future__ import annotations

OK = 0
ERROR = 2  # a CONFIG_ERROR or any other ``[CODE]`` error (and argparse's usage errors): one line, no traceback
HANDLERS_ABANDONED = 3  # `conveyor run`: handlers still running at --graceful-timeout; their messages given back
WORKERS_DIED = 4  # `conveyor run --workers N`: a worker died during the run (restarted) or was killed at the stop
INTERRUPTED = 130  # SIGINT (Ctrl-C) where a command has no graceful stop of its own (128 + SIGINT)
BROKEN_PIPE = 141  # stdout closed early (`conveyor tail ... | head`): stop quietly, as `cat` does (128 + SIGPIPE)
