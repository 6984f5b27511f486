"""One consumer that acks everything: a runner whose health the probe tests watch."""

from __future__ import annotations

from conveyor import Message, consumer


@consumer("probed", group="probes", prefetch=10)
def probed(message: Message) -> None:
    return None
