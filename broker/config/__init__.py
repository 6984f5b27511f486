"""What options and settings are: their schema, units, the topic and broker settings, and where values come from.

Flags, ``CONVEYOR_*`` variables and TOML files are all checked against the same declarations.
"""
