"""Cluster coordination: what etcd keeps and what the cluster decides.

Membership, the controller, partition assignments, leaders with their epochs
and in-sync sets live in etcd; messages never do. This layer talks to etcd
and makes the decisions (pure functions); the broker's loop (``server``)
acts on them. It uses ``config`` and ``wire`` only, and nothing outside
``cluster/etcd.py`` imports the etcd client, so single-node mode loads none
of it.
"""
