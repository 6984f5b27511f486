"""Conveyor: decorators."""
