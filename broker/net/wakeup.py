"""The self-pipe that wakes an event loop from signal handlers and other threads."""

from __future__ import annotations

import socket


def drain(sock: socket.socket) -> None:
    """Empty a non-blocking wake-up socket so the next poll sleeps again."""
    try:
        while sock.recv(4096):
            pass
    except (BlockingIOError, OSError):
        pass
