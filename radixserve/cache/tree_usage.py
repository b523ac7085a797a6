"""How the radix tree is used, for the dashboard: hit counts per node (`count_use`, once per
admitted request) and the most useful prefixes (`summarize`, a bounded best-first walk from the
root by tokens served). The walk runs on the engine thread between steps, so its cost is capped
by the nodes it looks at, never by the size of the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from typing import Protocol

from radixserve.cache.base import Namespace, PrefixNode, TreeSummary

__all__ = ["TreeSummary", "count_use", "summarize"]
from radixserve.cache.pins import NOT_PINNED


class SummaryNode(Protocol):
    """What these functions use of a tree node (radix._Node)."""

    key: tuple[int, ...]
    parent: SummaryNode | None
    child_key: Hashable
    depth: int  # tokens from the root to the end of this node's edge
    serial: int
    hits: int
    last_used: float
    lock_ref: int
    pinned_until: float

    @property
    def children(self) -> dict[Hashable, SummaryNode]: ...


def count_use(root: SummaryNode, node: SummaryNode, now: float) -> None:
    """Counts one use of the path root -> `node`: a hit and a last-use time on each edge."""
    while node is not root:
        node.hits += 1
        node.last_used = now
        # Re-inserted last, so each node's children stay in order of last use and `summarize`
        # can look at the most recently used first. O(1) per level.
        parent = node.parent
        assert parent is not None
        del parent.children[node.child_key]
        parent.children[node.child_key] = node
        node = parent


# (-served tokens, -last use, serial, node, namespace, parent serial): best first; serials are
# unique, so nodes are never compared.
_Candidate = tuple[int, float, int, SummaryNode, Namespace, int | None]


def summarize(
    root: SummaryNode, nodes: int, now: float, limit: int, visit_limit: int,
    visible: Callable[[Namespace], bool] | None = None, first_tokens: int = 16,
) -> TreeSummary:
    """Pops the best candidate, reports it, and offers its children, until `limit` nodes are
    reported. At most `visit_limit` children are looked at in all, newest first: the tree keeps
    each node's children in order of last use (RadixCache.record_use), so a wide node (a shared
    system prompt under 100k user turns) is cut to its most recently used children. What that
    gives up: a child much served long ago but unused since may be missed behind newer ones."""
    heap: list[_Candidate] = []
    budget = visit_limit
    truncated = False

    def offer(parent: SummaryNode, parent_id: int | None, namespace: Namespace) -> None:
        nonlocal budget, truncated
        children = parent.children
        if len(children) > budget:
            truncated = True
        for key, child in itertools.islice(reversed(children.items()), max(budget, 0)):
            budget -= 1
            if parent is root:
                namespace = key[0]  # the root's children are keyed by (namespace, first token)
                if visible is not None and not visible(namespace):
                    continue
            served = child.hits * len(child.key)
            heapq.heappush(heap, (-served, -child.last_used, child.serial, child, namespace,
                                  parent_id))

    offer(root, None, None)
    shown: list[PrefixNode] = []
    while heap and len(shown) < limit:
        neg_served, _, serial, node, namespace, parent_id = heapq.heappop(heap)
        pinned = node.pinned_until - now if node.pinned_until != NOT_PINNED else None
        shown.append(PrefixNode(
            node_id=serial, parent_id=parent_id, namespace=namespace, tokens=len(node.key),
            depth=node.depth - len(node.key), hits=node.hits, served_tokens=-neg_served,
            last_used_s_ago=max(0.0, now - node.last_used), locks=node.lock_ref,
            pinned_for_s=pinned if pinned is not None and pinned > 0 else None,
            first_token_ids=node.key[:first_tokens]))
        offer(node, serial, namespace)
    return TreeSummary(nodes=nodes, prefixes=tuple(shown), truncated=truncated or bool(heap))
