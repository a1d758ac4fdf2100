"""Exact-prefix reuse across requests: recent sequences kept in the arena, shared copy-on-write.

A new request forks the kept sequence with the longest common prefix of token identities (text ids,
and image keys for image tokens) and truncates the fork to that prefix: the prefix's full blocks are
shared, nothing in it is recomputed. Entries go least recently used first, and all of them go when
the arena runs short (the Runtime then retries the request once). Not thread-safe (nor is the
arena): a Runtime touches it only holding its lock.
"""
from __future__ import annotations

from collections import OrderedDict

from .arena import Sequence


class PrefixCache:
    def __init__(self, max_entries: int = 4, min_tokens: int = 16) -> None:
        self.max_entries, self.min_tokens = max_entries, min_tokens
        self._entries: OrderedDict[int, tuple[tuple, Sequence]] = OrderedDict()
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, identity: list) -> tuple[Sequence | None, int]:
        """A fork of the kept sequence sharing the longest prefix with ``identity``, truncated to it,
        and the prefix length; (None, 0) when no prefix of at least ``min_tokens`` is kept."""
        best_id, best_len = None, 0
        for entry_id, (held, _) in self._entries.items():
            n = common_prefix(held, identity)
            if n > best_len:
                best_id, best_len = entry_id, n
        if best_id is None or best_len < self.min_tokens:
            return None, 0
        self._entries.move_to_end(best_id)
        fork = self._entries[best_id][1].fork()
        fork.truncate(best_len)
        return fork, best_len

    def insert(self, identity: list, seq: Sequence) -> None:
        """Keeps ``seq`` (taking ownership) for later requests; ``identity`` covers its tokens."""
        if len(identity) < self.min_tokens or self.max_entries == 0:
            seq.free()
            return
        self._entries[self._next_id] = (tuple(identity), seq)
        self._next_id += 1
        while len(self._entries) > self.max_entries:
            _, (_, old) = self._entries.popitem(last=False)
            old.free()

    def clear(self) -> None:
        while self._entries:
            _, (_, seq) = self._entries.popitem(last=False)
            seq.free()


def common_prefix(a, b) -> int:
    """Length of the common prefix of two sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
