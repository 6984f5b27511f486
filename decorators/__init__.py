"""Declare consumers: ``@consumer``, ``@retry_policy`` and ``@error_handler``."""

if __name__ != "conveyor.decorators":
    raise ImportError(f"import conveyor.decorators, not {__name__} (the repository's folders install under conveyor)")


from conveyor.decorators.consumer import AckPolicy, Consumer, consumer, error_handler
from conveyor.decorators.exceptions import InvalidMessage, Nack, Reject
from conveyor.decorators.policy import Decision, RetryPolicy
from conveyor.decorators.retry import retry_policy

__all__ = [
    "AckPolicy",
    "Consumer",
    "Decision",
    "InvalidMessage",
    "Nack",
    "Reject",
    "RetryPolicy",
    "consumer",
    "error_handler",
    "retry_policy",
]
