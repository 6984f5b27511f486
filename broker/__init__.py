"""Conveyor: broker."""
