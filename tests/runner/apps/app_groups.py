"""Consumers with default groups and start positions, as most users write them."""

from __future__ import annotations

from app_record import record

from conveyor import Message, consumer


@consumer("history")  # group app_groups.history; starts where the runner's --default-start says
def history(message: Message) -> None:
    record("history", message)


@consumer("pinned", start="earliest")  # says where it starts: --default-start does not move it
def pinned(message: Message) -> None:
    record("pinned", message)
