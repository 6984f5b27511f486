"""The broker: one event loop around one ROUTER socket (``broker.Broker``), and the small classes it drives.

Confirms, fetch waits, peers, the group table, dead letters and health each live in their own module and see
only the narrow interface they need, never the whole ``Broker``.
"""
