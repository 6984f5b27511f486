"""A small shop built on Conveyor: orders are billed, invoices published and customers notified.

- ``models.py``: ``Order``, ``OrderLine`` and ``Invoice`` (dataclasses: typed messages);
- ``handlers.py``: the consumers, ``conveyor run examples.shop.handlers``;
- ``middleware.py``: ``AuditLog``, one line per message outcome with its time;
- ``payments.py``: a stand-in payment provider that times out now and then;
- ``tracing.py``: OpenTelemetry spans to the console (``OTEL_TRACES_EXPORTER=console``);
- ``place_orders.py``: the producer, ``python -m examples.shop.place_orders --count 10``;
- ``demo.py``: all of it with one command, ``make example`` (README, "Example service").
"""
