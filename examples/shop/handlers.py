"""The shop's consumers: ``conveyor run examples.shop.handlers``.

::

    shop.orders ──bill──▶ shop.invoices ──notify──▶ (an e-mail, here a log line)
         │
         └─ invalid or declined orders ──▶ shop.orders.dlq   (conveyor dlq list shop.orders.dlq)

- ``bill`` takes a typed ``Order``, charges it (the provider times out now and then:
  ``@retry_policy`` retries through the broker with a backoff) and publishes an
  ``Invoice`` from the handler. With confirm-before-ack (the default) the order is acked
  only once the invoice is durable, so a runner that dies in between bills again rather
  than losing the invoice; the invoice number comes from the order id, so ``notify`` can
  tell a repeat.
- An order that breaks ``Order``'s rules is dead-lettered by the runner before ``bill``
  sees it; a declined card is ``Reject``-ed: both end in ``shop.orders.dlq`` with the reason.
- ``notify`` takes a typed ``Invoice`` and "e-mails" the customer.
- ``middleware = [AuditLog()]`` wraps both; with ``OTEL_TRACES_EXPORTER=console`` each order is
  one trace, printed span by span (``examples/shop/tracing.py``).
"""

from __future__ import annotations

import logging

from conveyor import Message, PublishFailed, Reject, consumer, error_handler, publish, retry_policy
from examples.shop import payments, tracing
from examples.shop.middleware import AuditLog
from examples.shop.models import INVOICES, ORDERS, Invoice, Order

log = logging.getLogger("examples.shop")

middleware = [AuditLog()]  # `conveyor run examples.shop.handlers` wraps every consumer below in it
tracing.setup("shop")  # spans to the console when OTEL_TRACES_EXPORTER=console (examples/shop/tracing.py)


@consumer(ORDERS, group="shop.billing", concurrency=4)
# A provider timeout or an invoice the broker did not confirm is retried (0.2 s, 0.4 s, 0.8 s later);
# anything else is a bug and goes to shop.orders.dlq at once.
@retry_policy(max_attempts=4, initial_delay=0.2, max_delay=2.0, retry_on=(payments.GatewayTimeout, PublishFailed))
def bill(message: Message[Order]) -> None:
    """Charge the order, then publish its invoice (acked only once the invoice is confirmed)."""
    order = message.value
    try:
        with tracing.span(f"charge {order.id}", **{"order.id": order.id, "shop.customer": order.customer}):
            payment = payments.charge(order, message.attempt)
    except payments.CardDeclined as exc:
        raise Reject(str(exc)) from exc  # straight to shop.orders.dlq: a retry would be declined again
    invoice = Invoice.for_order(order)
    publish(INVOICES, invoice, key=order.customer, headers={"payment-id": payment})
    log.info(
        "billed %s: %s %s to %s (attempt %d)", order.id, order.currency, order.total, order.customer, message.attempt
    )


@error_handler(bill)
def order_not_billed(message: Message, exc: BaseException) -> None:
    """Runs for every order that ends in shop.orders.dlq: invalid, declined, or out of retries."""
    order_id = message.value.get("id", "?") if isinstance(message.value, dict) else getattr(message.value, "id", "?")
    log.warning("order %s not billed, see `conveyor dlq list %s.dlq`: %s", order_id, ORDERS, exc)


@consumer(INVOICES, group="shop.notifications")
def notify(invoice: Invoice) -> None:
    """Send the invoice to the customer (a log line stands in for the e-mail)."""
    log.info("e-mailed %s: invoice %s, %s %s", invoice.customer, invoice.number, invoice.currency, invoice.total)
