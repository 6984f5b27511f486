"""What @consumer and @retry_policy refuse when a consumer is declared, and what the policy tells the broker."""

from __future__ import annotations

import time

import pytest
import tenacity
from conveyor.consumers.lanes import _delay_ms
from conveyor.decorators.retry import UNBOUNDED_DELIVERIES, RetryPolicy

from conveyor import Nack, consumer, retry_policy


def handler(message):
    return None


@pytest.mark.parametrize(
    "options",
    [
        {"prefetch": -1},
        {"concurrency": 0},
        {"batch_size": 0},
        {"batch": "yes"},
        {"key_ordered": 1},
        {"ack_timeout_ms": 0},
        {"ack_timeout_ms": 2**31},
        {"concurrency": 2.5},
        {"batch": True, "batch_size": 50, "prefetch": 10},
    ],
)
def test_impossible_consumer_options_are_refused_when_declared(options):
    with pytest.raises(TypeError):
        consumer("t", **options)(handler)


@pytest.mark.parametrize(
    "options",
    [
        {"jitter": -1},
        {"initial_delay": -0.1},
        {"multiplier": 0.5},
        {"max_attempts": 0},
        {"max_attempts": True},
        {"max_delay": 1, "initial_delay": 2},
        {"max_attempts": 3, "stop": tenacity.stop_after_attempt(3)},
        {"max_delay": 5, "wait": tenacity.wait_fixed(1)},
        {"backoff": "fixed", "wait": tenacity.wait_fixed(1)},
        {"stop": 3},
        {"dead_letter": 7},
        # Past the wire's max_deliveries (a signed 32-bit count): refused here, not at SUBSCRIBE.
        {"max_attempts": 2**31},
        {"stop": tenacity.stop_after_attempt(2**40)},
        {"stop": tenacity.stop_after_attempt(0)},
        {"stop": tenacity.stop_after_attempt(3) | tenacity.stop_after_attempt(2**31)},
        # nan and inf delays: nan compared as neither small nor large and was taken as 0.
        {"initial_delay": float("nan")},
        {"max_delay": float("inf")},
        {"multiplier": float("nan")},
        {"jitter": float("inf")},
        {"stop": tenacity.stop_after_delay(float("nan"))},
        {"wait": tenacity.wait_fixed(float("inf"))},
        {"wait": tenacity.wait_fixed(1) + tenacity.wait_random(0, float("nan"))},
    ],
)
def test_impossible_retry_settings_are_refused_when_declared(options):
    with pytest.raises(TypeError):
        retry_policy(**options)


def test_the_largest_counts_the_wire_carries_are_accepted():
    assert RetryPolicy(max_attempts=2**31 - 1).attempts_limit == 2**31 - 1
    assert RetryPolicy(stop=tenacity.stop_after_attempt(2**31 - 1)).attempts_limit == 2**31 - 1


def test_dead_lettering_into_the_consumers_own_topic_is_refused_either_way_round():
    with pytest.raises(TypeError, match="own topic"):
        consumer("orders")(retry_policy(dead_letter="orders")(handler))
    with pytest.raises(TypeError, match="own topic"):
        retry_policy(dead_letter="orders")(consumer("orders")(handler))
    consumer("orders")(retry_policy(dead_letter="orders.failed")(handler))


@pytest.mark.parametrize(
    ("stop", "limit"),
    [
        (None, 5),
        (tenacity.stop_after_attempt(15), 15),
        (tenacity.stop_after_attempt(15) | tenacity.stop_after_attempt(4), 4),
        (tenacity.stop_after_attempt(7) | tenacity.stop_after_delay(60), 7),
        (tenacity.stop_after_attempt(3) & tenacity.stop_after_attempt(9), 9),
        (tenacity.stop_after_attempt(3) & tenacity.stop_after_delay(60), UNBOUNDED_DELIVERIES),
        (tenacity.stop_after_delay(60), UNBOUNDED_DELIVERIES),
        (tenacity.stop_never, UNBOUNDED_DELIVERIES),
    ],
)
def test_the_policy_tells_the_broker_its_delivery_limit(stop, limit):
    assert RetryPolicy(stop=stop).attempts_limit == limit


def test_max_delay_caps_only_the_built_in_backoffs():
    own = RetryPolicy(wait=tenacity.wait_fixed(120))
    assert own.decide(RuntimeError("x"), 1).delay == 120
    built = RetryPolicy(initial_delay=10, multiplier=4, max_delay=30)
    assert built.decide(RuntimeError("x"), 3).delay == 30


def test_stop_after_delay_measures_from_the_first_delivery():
    policy = RetryPolicy(stop=tenacity.stop_after_delay(5), wait=tenacity.wait_fixed(0))
    assert policy.decide(RuntimeError("x"), 2, first_delivered=time.time() - 1).retry
    assert not policy.decide(RuntimeError("x"), 2, first_delivered=time.time() - 6).retry


@pytest.mark.parametrize("delay", [float("nan"), float("inf"), -1, True, "1"])
def test_a_nack_delay_that_is_no_duration_is_refused_where_it_is_raised(delay):
    with pytest.raises(TypeError, match="Nack delay"):
        Nack(delay=delay)


def test_a_wait_of_the_users_that_returns_nan_or_inf_never_breaks_the_runner():
    assert (_delay_ms(float("inf")), _delay_ms(1e300), _delay_ms(float("nan"))) == (2**63 - 1, 2**63 - 1, 0)
    assert (_delay_ms(1.5), _delay_ms(-3)) == (1500, 0)
