"""The topic log on disk and in memory: segments, the data directory, the idempotence window, durable writes.

The broker talks to it through ``topic_log.TopicLog``; the fault layer in ``syscalls`` sits under every write.
"""
