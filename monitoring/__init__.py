"""Conveyor: monitoring."""
