"""The clients: ``Producer``, ``AsyncProducer``, ``Admin``, ``Subscription`` and the ``Message`` they hand out.

The common names are re-exported by ``conveyor`` itself (``from conveyor import Producer``).
"""
