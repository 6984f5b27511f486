"""Conveyor broker: the topic log, the ZeroMQ server and the clients."""

__version__ = "0.1.0"
