"""The broker's consumer groups, by (topic, group) and by topic.

A pass that appended to a topic wakes that topic's groups: looking them up
must cost what the topic has, not what the broker has (a broker may hold
100,000 groups, nearly all idle). The index keeps the by-topic view in step
with every insertion and removal of the plain mapping.
"""

from __future__ import annotations

from typing import Any

from conveyor.broker.server.groups import Group

Key = tuple[str, str]


class GroupIndex(dict[Key, Group]):
    """``{(topic, group): Group}`` that also answers ``of_topic(topic)`` in O(groups of that topic)."""

    def __init__(self) -> None:
        super().__init__()
        self._by_topic: dict[str, dict[str, Group]] = {}

    def __setitem__(self, key: Key, group: Group) -> None:
        super().__setitem__(key, group)
        self._by_topic.setdefault(key[0], {})[key[1]] = group

    def __delitem__(self, key: Key) -> None:
        super().__delitem__(key)
        self._unindex(key)

    def pop(self, key: Key, *default: Any) -> Any:
        if key in self:
            self._unindex(key)
        return super().pop(key, *default)

    def clear(self) -> None:
        super().clear()
        self._by_topic.clear()

    def _unindex(self, key: Key) -> None:
        topic = self._by_topic.get(key[0])
        if topic is not None:
            topic.pop(key[1], None)
            if not topic:
                del self._by_topic[key[0]]

    def of_topic(self, topic: str) -> list[Group]:
        """The groups of ``topic`` (a copy: safe to change the index while walking it)."""
        return list(self._by_topic.get(topic, {}).values())

    def names_of_topic(self, topic: str) -> list[str]:
        return sorted(self._by_topic.get(topic, {}))
