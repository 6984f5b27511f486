"""Consuming: the ``Message`` handlers receive, the ``Runner``, and handler exceptions (``InvalidMessage``)."""

if __name__ != "conveyor.consumers":
    raise ImportError(f"import conveyor.consumers, not {__name__} (the repository's folders install under conveyor)")


from conveyor.broker.client.message import Message
from conveyor.broker.client.subscription import DeadLettered
from conveyor.decorators.exceptions import InvalidMessage, Nack, Reject

__all__ = ["DeadLettered", "InvalidMessage", "Message", "Nack", "Reject", "Runner", "Subscription"]


def __getattr__(name: str) -> object:
    # Imported on first use: the runner pulls in threads and sockets, a Message does not.
    if name == "Runner":
        from conveyor.consumers.runner import Runner

        return Runner
    if name == "Subscription":
        from conveyor.broker.client.subscription import Subscription

        return Subscription
    raise AttributeError(name)
