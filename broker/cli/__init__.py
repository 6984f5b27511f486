"""The ``conveyor`` command: one parser, a subcommand per job (broker, run, publish, tail, topics, groups, bench ...).

The top of the layers: it may import anything, and nothing imports it.
"""
