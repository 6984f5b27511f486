"""Consuming: the ``Message`` handlers receive, the ``Runner``, and handler exceptions."""

from consumers.exceptions import DeadLettered, Nack, Reject
from consumers.message import Message

__all__ = ["DeadLettered", "Message", "Nack", "Reject", "Runner", "Subscription"]


def __getattr__(name: str) -> object:
    # Imported on first use: the runner pulls in threads and sockets, a Message does not.
    if name == "Runner":
        from consumers.runner import Runner

        return Runner
    if name == "Subscription":
        from consumers.session import Subscription

        return Subscription
    raise AttributeError(name)
