"""Two handlers with nothing about tracing in them: ``conveyor run --trace console`` traces them.

The handler of ``traced-orders`` logs and publishes to ``traced-invoices``, whose handler logs.
"""

from __future__ import annotations

import logging
from typing import Any

from conveyor import consumer, publish

log = logging.getLogger("app_tracing")


@consumer("traced-orders", group="traced-billing")
def bill(message: Any) -> None:
    log.warning("billing %s", message.value)
    publish("traced-invoices", message.value)


@consumer("traced-invoices", group="traced-mailer")
def mail(message: Any) -> None:
    log.warning("mailing %s", message.value)
