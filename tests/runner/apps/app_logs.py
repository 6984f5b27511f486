"""A handler that logs and fails once: its log lines (and the runner's) carry the message's fields."""

from __future__ import annotations

import logging

from conveyor import Message, consumer, retry_policy

log = logging.getLogger("app_logs")


@consumer("logged", group="logged")
@retry_policy(max_attempts=3, initial_delay=0.05, backoff="fixed")
def logged(message: Message) -> None:
    log.info("handling %s", message.value)
    if message.attempt < 2:
        raise ConnectionError(f"transient failure on attempt {message.attempt}")
    log.warning("handled %s", message.value, extra={"attempt": 99})  # extra= wins over the context
