"""Sockets: the one way a client DEALER is set up (CURVE, high-water marks), request/reply with retry, and transport.

Uses ``wire`` for frames; knows nothing of the log or the server.
"""
