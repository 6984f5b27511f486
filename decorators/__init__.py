"""Declare consumers: ``@consumer``, ``@retry_policy`` and ``@error_handler``."""

from consumers.exceptions import Nack, Reject
from decorators.consumer import AckPolicy, Consumer, consumer, error_handler
from decorators.retry import Decision, RetryPolicy, retry_policy

__all__ = [
    "AckPolicy",
    "Consumer",
    "Decision",
    "Nack",
    "Reject",
    "RetryPolicy",
    "consumer",
    "error_handler",
    "retry_policy",
]
