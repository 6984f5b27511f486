"""``RetryPolicy`` as a specification: after attempt n failed with an error, retry (a NACK with this
delay) or give up (a TERM into the dead-letter topic).

The runner carries these decisions out and the broker counts the attempts; here each decision is
computed in-process, attempt by attempt, for the built-in backoffs and for tenacity's own strategies.
"""

from __future__ import annotations

import pytest
import tenacity
from conveyor.decorators import Decision, RetryPolicy, retry_policy
from conveyor.decorators.policy import RETRY_OPTIONS, default_retriable, describe

BOOM = RuntimeError("boom")


def delays(policy: RetryPolicy, attempts: int, exc: BaseException = BOOM) -> list[float | None]:
    """The NACK delay after each failed attempt, or None where the policy gives up."""
    decisions = [policy.decide(exc, n) for n in range(1, attempts + 1)]
    return [d.delay if d.retry else None for d in decisions]


# --- retry or dead-letter, and the delay of each retry ---------------------------------------------------


def test_the_default_policy_retries_four_times_doubling_from_half_a_second_then_gives_up():
    assert delays(RetryPolicy(), 5) == [0.5, 1.0, 2.0, 4.0, None]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"backoff": "fixed", "initial_delay": 2}, [2, 2, 2, 2, None]),
        ({"backoff": "linear", "initial_delay": 1}, [1, 2, 3, 4, None]),
        ({"backoff": "exponential", "initial_delay": 1, "multiplier": 3}, [1, 3, 9, 27, None]),
        ({"backoff": "exponential", "initial_delay": 1, "max_delay": 5}, [1, 2, 4, 5, None]),
        ({"backoff": "linear", "initial_delay": 2, "max_delay": 5}, [2, 4, 5, 5, None]),
        ({"max_attempts": 1}, [None, None, None, None, None]),
        ({"max_attempts": 2, "initial_delay": 0}, [0, None, None, None, None]),
    ],
)
def test_each_attempt_is_retried_with_its_delay_until_max_attempts(options, expected):
    assert delays(RetryPolicy(**options), 5) == expected


def test_jitter_adds_at_most_its_own_bound():
    policy = RetryPolicy(backoff="fixed", initial_delay=1, jitter=0.5)
    for attempt in (1, 2, 3, 4):
        assert 1 <= policy.decide(BOOM, attempt).delay <= 1.5


def test_the_decision_says_why():
    assert RetryPolicy().decide(BOOM, 1) == Decision(True, 0.5, "RuntimeError: boom")
    gave_up = RetryPolicy(max_attempts=2).decide(BOOM, 2)
    assert (gave_up.retry, gave_up.reason) == (False, "gave up after 2 attempts: RuntimeError: boom")
    long = describe(ValueError("x" * 10_000))  # the reason travels in a header: bounded
    assert long.startswith("ValueError: x") and len(long) == 4096


# --- which errors are retried ----------------------------------------------------------------------------


class Permanent(Exception):
    retriable = False


def test_an_error_that_says_it_is_not_retriable_is_dead_lettered_at_once():
    assert not default_retriable(Permanent())
    decision = RetryPolicy().decide(Permanent("bad input"), 1)
    assert (decision.retry, decision.reason) == (False, "not retriable: Permanent: bad input")


def test_retry_on_retries_only_those_errors_and_give_up_on_wins_over_it():
    policy = RetryPolicy(retry_on=(OSError,), give_up_on=TimeoutError)
    assert policy.decide(ConnectionError(), 1).retry  # an OSError
    assert not policy.decide(ValueError(), 1).retry  # not named
    assert not policy.decide(TimeoutError(), 1).retry  # an OSError, but given up on
    assert policy.give_up_on == (TimeoutError,)  # one type is taken as a tuple of one


def test_retry_on_also_retries_errors_that_say_they_are_not_retriable():
    assert RetryPolicy(retry_on=Permanent).decide(Permanent(), 1).retry


# --- tenacity's own strategies, taken as they are --------------------------------------------------------


def test_a_tenacity_stop_replaces_max_attempts():
    policy = RetryPolicy(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_fixed(1))
    assert delays(policy, 4) == [1, 1, None, None]
    assert policy.attempts_limit == 3


def test_a_tenacity_wait_is_taken_as_given_even_past_max_delay():
    policy = RetryPolicy(wait=tenacity.wait_chain(tenacity.wait_fixed(1), tenacity.wait_fixed(100)))
    assert delays(policy, 5) == [1, 100, 100, 100, None]


def test_a_tenacity_retry_predicate_replaces_the_error_rules():
    policy = RetryPolicy(retry=tenacity.retry_if_exception_type(KeyError), wait=tenacity.wait_fixed(0))
    assert policy.decide(KeyError("k"), 1).retry
    assert not policy.decide(BOOM, 1).retry


def test_stop_before_delay_sees_the_delay_about_to_be_waited():
    policy = RetryPolicy(stop=tenacity.stop_before_delay(10), wait=tenacity.wait_fixed(20))
    assert not policy.decide(BOOM, 1).retry


def test_a_wait_of_the_users_below_zero_is_no_wait():
    assert RetryPolicy(wait=lambda state: -5).decide(BOOM, 1).delay == 0


def test_a_wait_function_sees_the_attempt_and_the_error():
    seen = []

    def wait(state):
        seen.append((state.attempt_number, type(state.outcome.exception()).__name__))
        return state.attempt_number * 10

    assert delays(RetryPolicy(wait=wait), 5) == [10, 20, 30, 40, None]
    assert seen[:2] == [(1, "RuntimeError"), (2, "RuntimeError")]


# --- the decorator's own checks --------------------------------------------------------------------------


def test_retry_policy_refuses_unknown_options_and_names_the_known_ones():
    with pytest.raises(TypeError, match="unknown retry_policy option\\(s\\): attempts, delay; known: backoff"):
        retry_policy(attempts=3, delay=1)
    assert "_built" not in RETRY_OPTIONS
    assert {"max_attempts", "stop", "wait", "retry", "dead_letter"} <= RETRY_OPTIONS


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"backoff": "random"}, "backoff must be one of exponential, fixed, linear"),
        ({"max_attempts": 0}, "max_attempts must be an int from 1"),
        ({"initial_delay": -1}, "initial_delay must be a finite number"),
        ({"multiplier": 0.5}, "multiplier must be at least 1"),
        ({"retry_on": "OSError"}, "retry_on takes exception types"),
        ({"dead_letter": 3}, "dead_letter takes a topic name"),
        ({"wait": 5}, "wait takes a tenacity strategy"),
        ({"stop": tenacity.stop_after_attempt(2), "max_attempts": 2}, "max_attempts or stop, not both"),
        ({"wait": tenacity.wait_fixed(1), "initial_delay": 2}, "initial_delay shapes the built-in backoffs"),
    ],
)
def test_values_are_checked_when_declared_and_the_error_names_the_option(options, named):
    with pytest.raises(TypeError, match=named):
        retry_policy(**options)
