"""The emulator's prefix cache: a token radix tree like SGLang's radix cache, bounded in tokens,
evicting the least recently used leaves.

SGLang's semantics: `match` gives the prompt tokens served from cache (never the last one, which
is always computed), `insert` adds a sequence once its prefill (or its whole request) is done.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Sequence

_TYPECODE = "q"


class _Node:
    """A tree node: the tokens on the edge from its parent, its children by first token."""

    __slots__ = ("children", "key", "last_use", "parent")

    def __init__(self, key: array[int], parent: _Node | None, last_use: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_use = last_use


def _common(key: array[int], ids: array[int], start: int) -> int:
    """How many leading tokens of key equal ids[start:]."""
    size = min(len(key), len(ids) - start)
    if key[:size] == ids[start : start + size]:
        return size
    low, high = 0, size  # key[:low] matches, key[:high] does not
    while high - low > 1:
        middle = (low + high) // 2
        if key[:middle] == ids[start : start + middle]:
            low = middle
        else:
            high = middle
    return low


class RadixCache:
    """Cached token sequences, sharing their common prefixes. max_tokens None: unbounded;
    0: no cache at all (SGLang's --disable-radix-cache: nothing is ever cached)."""

    def __init__(self, max_tokens: int | None = None) -> None:
        if max_tokens is not None and max_tokens < 0:
            raise ValueError("max_tokens must be >= 0 or None")
        self.max_tokens = max_tokens
        self._clock = itertools.count(1)
        self._root = _Node(array(_TYPECODE), None, 0)
        self.tokens = 0  # tokens held by the tree
        self.evicted_tokens = 0

    def match(self, ids: Sequence[int]) -> int:
        """Prompt tokens served from cache: the longest cached prefix, at most len(ids) - 1.
        The nodes on the path count as used (LRU)."""
        tokens = _as_array(ids)
        limit = len(tokens) - 1
        if limit <= 0 or self.max_tokens == 0:
            return 0
        now = next(self._clock)
        node, matched = self._root, 0
        while matched < limit:
            child = node.children.get(tokens[matched])
            if child is None:
                break
            common = _common(child.key, tokens, matched)
            if common < len(child.key):  # as SGLang: split, so only the used part is touched
                self._split(child, common).last_use = now
                matched += common
                break
            child.last_use = now
            matched += common
            node = child
        return min(matched, limit)

    def insert(self, ids: Sequence[int]) -> None:
        """Remember a sequence (a prefilled prompt, or a finished request's prompt + output),
        then evict least recently used leaves until the tree fits max_tokens."""
        if self.max_tokens == 0:
            return
        tokens = _as_array(ids)
        now = next(self._clock)
        node, position = self._root, 0
        while position < len(tokens):
            child = node.children.get(tokens[position])
            if child is None:
                leaf = _Node(tokens[position:], node, now)
                node.children[tokens[position]] = leaf
                self.tokens += len(leaf.key)
                break
            common = _common(child.key, tokens, position)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_use = now
            node, position = child, position + common
        self._evict()

    def clear(self) -> None:
        self._root = _Node(array(_TYPECODE), None, 0)
        self.tokens = 0

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut child's edge after `at` tokens; return the new node holding the first part."""
        parent = child.parent
        assert parent is not None
        middle = _Node(child.key[:at], parent, child.last_use)
        parent.children[child.key[0]] = middle
        child.key = child.key[at:]
        child.parent = middle
        middle.children[child.key[0]] = child
        return middle

    def _evict(self) -> None:
        """Every node may go: the emulator does not model the KV that running requests hold."""
        if self.max_tokens is None or self.tokens <= self.max_tokens:
            return
        order = itertools.count()
        leaves = [(n.last_use, next(order), n) for n in self._leaves()]
        heapq.heapify(leaves)
        while self.tokens > self.max_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.tokens -= len(leaf.key)
            self.evicted_tokens += len(leaf.key)
            if parent is not self._root and not parent.children:
                heapq.heappush(leaves, (parent.last_use, next(order), parent))

    def _leaves(self) -> list[_Node]:
        found: list[_Node] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                found.append(node)
        return found


def _as_array(ids: Sequence[int]) -> array[int]:
    return ids if isinstance(ids, array) else array(_TYPECODE, ids)
