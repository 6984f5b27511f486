"""The version of Conveyor, in one place (the packaging metadata says the same)."""

__version__ = "0.1.0"
