"""The broker side of Conveyor, in layers: ``wire`` and ``config`` at the bottom, ``net`` and ``log`` on them,
``server`` and ``client`` above, ``cli`` on top. ARCHITECTURE.md draws the layers and the rule that keeps them.

This folder installs as ``conveyor.broker``; imported under any other name (``import broker`` from the
repository root) it refuses, so that no module is ever loaded twice under two names.
"""

if __name__ != "conveyor.broker":
    raise ImportError(f"import conveyor.broker, not {__name__} (the repository's folders install under conveyor)")
