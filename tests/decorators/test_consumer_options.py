"""``@consumer`` as a specification: what it accepts, what it refuses at decoration time, and why.

In-process: a decorated function is data (a ``Consumer``) that the runner reads, so each rule is
checked here without a broker. Errors must name the option, so a typo is found where it is written.
"""

from __future__ import annotations

import pytest
from conveyor.decorators import AckPolicy, Consumer, RetryPolicy, consumer, error_handler, retry_policy
from conveyor.decorators.consumer import OPTIONS


def handler(message):
    return message


async def async_handler(message):
    return message


# --- unknown and impossible options ----------------------------------------------------------------------


@pytest.mark.parametrize("typo", ["grup", "batchsize", "max_attempts", "retry", "ack"])
def test_an_unknown_option_is_refused_before_any_function_is_decorated(typo):
    with pytest.raises(TypeError, match=f"unknown consumer option\\(s\\): {typo}; known: group, batch"):
        consumer("t", **{typo: 1})


def test_the_error_names_every_unknown_option_and_every_known_one():
    with pytest.raises(TypeError) as caught:
        consumer("t", zeta=1, alpha=2)
    message = str(caught.value)
    assert "alpha, zeta" in message
    assert all(name in message for name in OPTIONS)


@pytest.mark.parametrize("topic", ["", None, 7, b"t"])
def test_a_consumer_needs_a_topic_name(topic):
    with pytest.raises(TypeError, match="needs a topic name"):
        consumer(topic)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"batch": 1}, "batch takes True or False"),
        ({"key_ordered": "yes"}, "key_ordered takes True or False"),
        ({"concurrency": 0}, "concurrency must be an int of at least 1"),
        ({"concurrency": True}, "concurrency must be an int"),
        ({"batch_size": 1.0}, "batch_size must be an int"),
        ({"prefetch": -1}, "prefetch must be an int of at least 0"),
        ({"ack_timeout_ms": 0}, "ack_timeout_ms must be an int of at least 1"),
        ({"ack_timeout_ms": 2**31}, "ack_timeout_ms must be at most"),
        ({"batch": True, "batch_size": 10, "prefetch": 5}, "no batch could ever fill"),
    ],
)
def test_values_are_checked_and_the_error_names_the_option(options, named):
    with pytest.raises(TypeError, match=named):
        consumer("t", **options)(handler)


def test_an_unknown_ack_policy_is_refused():
    with pytest.raises(ValueError, match="'later'"):
        consumer("t", ack_policy="later")(handler)


def test_only_functions_are_decorated_and_only_once():
    with pytest.raises(TypeError, match="decorates a function"):
        consumer("t")(42)
    once = consumer("t")(handler)
    with pytest.raises(TypeError, match="already a consumer"):
        consumer("u")(once)


def test_error_handler_takes_the_consumer_it_watches():
    with pytest.raises(TypeError, match="takes the @consumer"):
        error_handler(handler)
    c = consumer("t")(handler)

    @error_handler(c)
    def hook(message, exc):
        return None

    assert c.error_handlers == [hook]
    assert hook(None, None) is None  # the hook stays a plain function


# --- what a declaration holds ----------------------------------------------------------------------------


def test_a_consumer_is_data_and_stays_callable_like_the_function():
    c = consumer("orders", ack_policy="early", key_ordered=True)(handler)
    assert isinstance(c, Consumer)
    assert (c.topic, c.ack_policy, c.key_ordered, c.is_async) == ("orders", AckPolicy.EARLY, True, False)
    assert c("m") == "m"
    assert (c.__name__, c.name) == ("handler", f"{__name__}.handler")
    assert consumer("orders")(async_handler).is_async


def test_the_group_defaults_to_the_functions_qualified_name_made_a_valid_group_name():
    def nested(message):
        return None

    assert consumer("t")(handler).group == f"{__name__}.handler"
    assert consumer("t", group="billing")(handler).group == "billing"
    group = consumer("t")(nested).group
    assert "<" not in group and ">" not in group


@pytest.mark.parametrize(
    ("options", "credit"),
    [
        ({}, 100),  # at least 100 in flight
        ({"concurrency": 4}, 256),  # 64 per lane
        ({"batch": True, "batch_size": 500}, 1000),  # two batches
        ({"prefetch": 7}, 7),  # given: taken as is
    ],
)
def test_the_credit_asked_of_the_broker(options, credit):
    assert consumer("t", **options)(handler).credit == credit


def test_without_a_retry_policy_the_default_one_applies():
    c = consumer("t")(handler)
    assert c.retry is None
    assert c.policy.describe() == RetryPolicy().describe()
    assert c.describe()["retry"]["max_attempts"] == 5


# --- both decorator orders -------------------------------------------------------------------------------


def below(fn):
    return consumer("t")(retry_policy(max_attempts=3, backoff="fixed", dead_letter="t.failed")(fn))


def above(fn):
    return retry_policy(max_attempts=3, backoff="fixed", dead_letter="t.failed")(consumer("t")(fn))


@pytest.mark.parametrize("declare", [below, above], ids=["retry_policy below", "retry_policy above"])
def test_retry_policy_works_above_or_below_consumer(declare):
    c = declare(handler)
    assert isinstance(c, Consumer)
    assert (c.retry.max_attempts, c.retry.backoff, c.retry.dead_letter) == (3, "fixed", "t.failed")
    assert c.describe()["retry"] == below(handler).describe()["retry"]


def test_retry_policy_refuses_what_is_neither_a_function_nor_a_consumer():
    with pytest.raises(TypeError, match="decorates a function or a @consumer"):
        retry_policy()(42)


def test_a_retry_that_is_no_policy_is_refused():
    with pytest.raises(TypeError, match="retry takes a RetryPolicy"):
        Consumer(handler, "t", "g", retry={"max_attempts": 3})
