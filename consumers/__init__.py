"""Conveyor: consumers."""
