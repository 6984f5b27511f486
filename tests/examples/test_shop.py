"""The example service (examples/shop), tested the way its README says to test a service like it.

The handlers run in the real runner against a real broker through ``run_consumers``; the last test
runs ``make example``'s command as a subprocess, start to clean stop.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from conveyor.consumers.context import CAUSATION_ID, CORRELATION_ID

from conveyor.testing import run_consumers
from examples.shop import handlers, place_orders
from examples.shop.handlers import bill, notify
from examples.shop.middleware import AuditLog
from examples.shop.models import INVOICES, ORDERS, Invoice, Order, OrderLine

REPO = Path(__file__).resolve().parents[2]


def test_an_order_is_billed_and_its_invoice_published_and_notified() -> None:
    [audit] = handlers.middleware  # the module's own, which run_consumers(handlers) wraps it in as conveyor run does
    order = place_orders.order(1)
    with run_consumers(handlers) as app:
        offset = app.publish(ORDERS, order, key=order.customer)
        [notified] = app.wait_handled(notify, count=1)
        [invoice] = app.messages(INVOICES, count=1)
        assert app.retried(bill) == [] and app.dead_lettered(bill) == []
    assert invoice.key == order.customer
    assert invoice.value["number"] == "INV-0001" and invoice.value["order_id"] == "ord-0001"
    assert Decimal(invoice.value["total"]) == order.total == Decimal("44.60")
    # published from the handler: linked to the order it was billed for, with the provider's payment id
    assert invoice.headers[CAUSATION_ID] == invoice.headers[CORRELATION_ID] == f"{app.topic(ORDERS)}/0/{offset}"
    assert invoice.headers["payment-id"] == "pay-ord-0001"
    assert notified.offset == invoice.offset
    assert audit.tallies[app.topic(ORDERS)].handled == 1
    assert audit.tallies[app.topic(INVOICES)].handled == 1


def test_a_provider_timeout_is_retried_through_the_broker_then_billed() -> None:
    audit = AuditLog()
    order = place_orders.order(4)  # the provider times out on the first try of every fourth order
    with run_consumers(bill, notify, middleware=[audit]) as app:
        app.publish(ORDERS, order)
        [billed] = app.wait_handled(bill, count=1)
        app.wait_handled(notify, count=1)
        assert [type(e).__name__ for e in app.errors(bill)] == ["GatewayTimeout"]
        assert billed.attempt == 2
        [invoice] = app.messages(INVOICES, count=1)
    assert invoice.value["number"] == "INV-0004"
    tally = audit.tallies[app.topic(ORDERS)]
    assert (tally.handled, tally.retried, tally.dead_lettered) == (1, 1, 0)


def test_invalid_and_declined_orders_go_to_the_dead_letter_topic_without_retry() -> None:
    no_lines, declined = place_orders.bad_order(5, 0), place_orders.bad_order(6, 1)
    with run_consumers(bill, notify) as app:
        app.publish(ORDERS, no_lines)
        app.publish(ORDERS, declined)
        app.wait_dead_lettered(bill, count=2)
        letters = app.dead_letters(ORDERS, count=2)
        assert app.retried(bill) == [] and app.handled(notify) == []
    reasons = sorted(letter.headers["x-last-error"] for letter in letters)
    assert reasons[0].startswith("invalid message: ") and "ord-0005 has no lines" in reasons[0], reasons
    assert reasons[1].startswith("rejected: card of mallory@example.com declined"), reasons


def test_the_orders_placed_are_the_same_every_run() -> None:
    plan = place_orders.plan(1, count=8, bad=2)
    assert [p.id if isinstance(p, Order) else p["id"] for p in plan] == [f"ord-{n:04d}" for n in range(1, 11)]
    bad = [p for p in plan if not isinstance(p, Order) or p.total > Decimal(5000)]
    again = place_orders.plan(1, count=8, bad=2)
    assert len(bad) == 2 and list(map(place_orders.describe, plan)) == list(map(place_orders.describe, again))
    assert Invoice.for_order(place_orders.order(7)).number == "INV-0007"
    with pytest.raises(ValueError, match="quantity 0"):
        Order(id="ord-1", customer="x@example.com", lines=[OrderLine("mug", 0, Decimal(1))])


def test_make_example_runs_the_shop_with_one_command() -> None:
    """What `make example` runs, as a subprocess: broker, runner, orders, dead letters, a clean stop."""
    recipe = re.search(r"^example:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), flags=re.M)
    assert recipe and "-m examples.shop.demo" in recipe.group(1), "make example no longer runs the demo"
    done = subprocess.run(
        [sys.executable, "-m", "examples.shop.demo", "--timeout", "30"],  # each of its waits: it ends by itself
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "placed 10 order(s) on shop.orders, 2 of them bad" in out, out
    assert len(set(re.findall(r"e-mailed \S+: invoice (INV-\d+)", out))) == 8, out
    assert "billed ord-0008" in out and "(attempt 2)" in out, out  # the fourth orders' retries
    assert "invalid message: Order: $: order ord-0004 has no lines" in out, out
    assert "rejected: card of mallory@example.com declined" in out, out
    assert re.search(r"audit shop\.orders: 8 handled, \d+ attempt\(s\) retried, 2 dead-lettered", out), out
    assert "runner | conveyor runner stopped cleanly" in out and "broker | stopped cleanly" in out, out
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        assert "tracing off" in out, out
    else:  # each order is one trace: the storefront's checkout, the runner's bill and notify (README, "Tracing")
        assert_one_trace_per_order(out)


SPAN = re.compile(r"^(\w+)\s*\| trace ([0-9a-f]{32}) span ([0-9a-f]{16}) parent (\S{16})  (.+?) \((\w+), ")


def assert_one_trace_per_order(out: str) -> None:
    """The console spans of ord-0002 (billed at once): from the producer's process to the handler of its invoice."""
    spans = [SPAN.match(line) for line in out.splitlines()]
    found = [(m[1], m[2], m[3], m[4], m[5], m[6]) for m in spans if m]
    [trace] = {t for _, t, _, _, name, _ in found if name == "checkout ord-0002"}
    in_trace = {(process, name, kind) for process, t, _, _, name, kind in found if t == trace}
    assert {
        ("orders", "checkout ord-0002", "INTERNAL"),
        ("orders", "send shop.orders", "PRODUCER"),
        ("runner", "process shop.orders", "CONSUMER"),
        ("runner", "charge ord-0002", "INTERNAL"),
        ("runner", "send shop.invoices", "PRODUCER"),
        ("runner", "process shop.invoices", "CONSUMER"),
    } <= in_trace, (in_trace, out)
    ids = {span for _, t, span, _, _, _ in found if t == trace}
    roots = [name for _, t, _, parent, name, _ in found if t == trace and parent not in ids]
    assert roots == ["checkout ord-0002"], (roots, out)  # one tree: every other span has its parent in it


def test_the_demo_prints_each_childs_line_whole_while_others_print() -> None:
    """Each child's output is echoed by a thread of its own: a line printed in two writes (print's text,
    then its newline, each flushed to the pipe) could end up inside another child's line, where the span
    parser of the test above then missed it."""
    echo = (
        "import threading\n"
        "from examples.shop.demo import say\n"
        "def echo(name):\n"
        "    for i in range(5000):\n"
        "        say(name, f'trace {i} ' + 'x' * 40)\n"
        "threads = [threading.Thread(target=echo, args=(n,)) for n in ('runner', 'orders')]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
    )
    done = subprocess.run([sys.executable, "-c", echo], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    torn = [line for line in lines if not re.fullmatch(r"(runner|orders) +\| trace \d+ x{40}", line)]
    assert not torn and len(lines) == 10_000, torn[:3]
