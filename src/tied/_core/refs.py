"""Child references: how a GraphDef's record names its children, defined here once.

A record is ``(kind, meta, child_refs)``; each child reference is one int that says what
the child is and which one: leaf (unique array) ``i`` is ``TAGS * i + LEAF``, node ``j`` is
``TAGS * j + NODE``, static ``k`` is ``TAGS * k + STATIC``. So ``r % TAGS`` is the tag and
``r // TAGS`` the index (`split_ref` gives both), a shared object is a number that occurs
twice, and references of one sort are ``TAGS`` apart. ``LEAF`` is 0: a leaf's reference is
``TAGS * i``, and a table indexed by reference holds the leaves at ``[LEAF::TAGS]``.

The builders and `split_ref` are for readers that go at a Python call's pace. The loops
that run once per place or per reference (the walk, `graph._walk`; the traversal,
`graphdef._traverse`; the layout replay and the generators in `plans/`) would spend a
call's cost on each: they write the same arithmetic inline with these names (``TAGS * j
+ NODE``, ``divmod(r, TAGS)``, ``r % TAGS == LEAF``), the hottest from locals bound to them
(``tags, node = TAGS, NODE``), since a global costs more to read than a literal.
"""

from __future__ import annotations

LEAF = 0  # a unique array: an index into the leaves `flatten` returns
NODE = 1  # a container node: an index into the GraphDef's records
STATIC = 2  # a static value: an index into the GraphDef's statics
TAGS = 3  # how many sorts there are: a reference is ``TAGS * index + tag``

__all__ = ["LEAF", "NODE", "STATIC", "TAGS", "leaf_ref", "node_ref", "split_ref", "static_ref"]


def leaf_ref(i: int) -> int:
    """The reference of unique array ``i``."""
    return TAGS * i + LEAF


def node_ref(j: int) -> int:
    """The reference of node record ``j``."""
    return TAGS * j + NODE


def static_ref(k: int) -> int:
    """The reference of static ``k``."""
    return TAGS * k + STATIC


def split_ref(r: int) -> tuple[int, int]:
    """``(tag, index)`` of reference ``r``: ``LEAF``, ``NODE`` or ``STATIC``, and which one."""
    index, tag = divmod(r, TAGS)
    return tag, index
