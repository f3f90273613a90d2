"""Prefix reuse: a radix tree over token ids whose edges hold the KV pool rows of those tokens (SGLang's
RadixAttention). Requests that share a prefix (a chat template's system prompt, few-shot examples, a document)
share its rows; unlocked leaves are evicted least recently used first when the pool runs short.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from scheduler.model.kv_pool import TokenKVPool
from sglang_constrained.backends.base import common_prefix_length


@dataclass(eq=False)
class TreeNode:
    """An edge of the tree: ``key`` token ids whose K/V are in pool rows ``value`` (same length)."""

    key: list[int]
    value: list[int]
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


class RadixCache:
    """The tree and its accounting: ``num_tokens`` rows held, ``num_evictable`` of them in unlocked nodes."""

    def __init__(self, pool: TokenKVPool) -> None:
        self.pool = pool
        self.root = TreeNode(key=[], value=[], lock_ref=1)
        self.num_tokens = 0
        self.num_evictable = 0
        self._clock = itertools.count(1)

    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], TreeNode]:
        """The rows of the longest cached prefix of ``token_ids``, and the node where it ends (split to fit)."""
        node, rows, position = self.root, [], 0
        now = next(self._clock)
        while position < len(token_ids):
            child = node.children.get(token_ids[position])
            if child is None:
                break
            shared = common_prefix_length(child.key, token_ids[position:])
            if shared < len(child.key):
                child = self._split(child, shared)
            child.last_access = now
            rows += child.value
            position += shared
            node = child
        return rows, node

    def insert(self, token_ids: list[int], rows: list[int]) -> int:
        """Cache ``rows`` as the K/V of ``token_ids``; returns how many leading tokens were cached already.

        The caller owns those leading rows it passed in duplicate and frees them (``rows[:returned]`` that are
        not the cached ones).
        """
        node, position = self.root, 0
        now = next(self._clock)
        while position < len(token_ids):
            child = node.children.get(token_ids[position])
            if child is None:
                leaf = TreeNode(key=token_ids[position:], value=rows[position:], parent=node, last_access=now)
                node.children[token_ids[position]] = leaf
                self.num_tokens += len(leaf.key)
                self.num_evictable += len(leaf.key)
                return position
            shared = common_prefix_length(child.key, token_ids[position:])
            if shared < len(child.key):
                child = self._split(child, shared)
            child.last_access = now
            position += shared
            node = child
        return position

    def lock(self, node: TreeNode) -> None:
        """Keep ``node`` and its ancestors from eviction (a running request reads them)."""
        while node is not self.root and node is not None:
            if node.lock_ref == 0:
                self.num_evictable -= len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root and node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable += len(node.key)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` rows from unlocked leaves, least recently used first; returns rows freed."""
        leaves = [(leaf.last_access, id(leaf), leaf) for leaf in self._unlocked_leaves()]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.pool.free(leaf.value)
            freed += len(leaf.value)
            self.num_tokens -= len(leaf.key)
            self.num_evictable -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def _unlocked_leaves(self) -> list[TreeNode]:
        leaves, pending = [], [self.root]
        while pending:
            node = pending.pop()
            if not node.children and node is not self.root and node.lock_ref == 0:
                leaves.append(node)
            pending.extend(node.children.values())
        return leaves

    def _split(self, child: TreeNode, length: int) -> TreeNode:
        """Cut ``child``'s edge after ``length`` tokens; returns the new upper node (locks carried over)."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(
            key=child.key[:length],
            value=child.value[:length],
            parent=parent,
            children={child.key[length]: child},
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        parent.children[upper.key[0]] = upper
        child.key, child.value, child.parent = child.key[length:], child.value[length:], upper
        return upper
