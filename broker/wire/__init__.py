"""The wire format, as pure functions: frames, the record batch, values, offset ranges, one encoder per command.

No sockets and no files here; everything above builds and reads frames through these modules.
"""
