"""The fsync policy: when a write becomes durable (``batch``, ``interval:MS``, ``none``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from conveyor.broker.config.topic_settings import INT32_MAX

from conveyor.errors import ConfigError


@dataclass(frozen=True, slots=True)
class FsyncPolicy:
    """``batch`` (group commit), ``interval:MS`` or ``none``."""

    mode: str = "batch"
    interval_ms: int = 0

    @classmethod
    def parse(cls, text: str) -> FsyncPolicy:
        match = re.fullmatch(r"(batch|none|always)|interval:(\d+)", text.strip())
        if not match:
            raise ConfigError(f"fsync policy must be batch, none or interval:MS, not {text!r}")
        if match.group(2):
            if int(match.group(2)) > INT32_MAX:  # it becomes a poll timeout: zmq takes a signed 32-bit count of ms
                raise ConfigError(f"fsync interval:MS must be at most interval:{INT32_MAX}, not {text!r}")
            return cls("interval", int(match.group(2)))
        return cls("batch" if match.group(1) == "always" else match.group(1))

    def __str__(self) -> str:
        return f"interval:{self.interval_ms}" if self.mode == "interval" else self.mode
