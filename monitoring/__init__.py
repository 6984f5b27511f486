"""Conveyor: monitoring."""

if __name__ != "conveyor.monitoring":
    raise ImportError(f"import conveyor.monitoring, not {__name__} (the repository's folders install under conveyor)")
