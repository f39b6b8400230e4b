"""The per-kind code of the plans: how a plan reads and checks, and how it builds, each kind of node.

Both generators write through this file: the straight-line plans of `compile.py` and the loop
bodies of `loops.py` (one element of a run of identical layers). For every kind of node there
is one emitter (``EMITTERS[kind]``), and every line it writes comes from a named template
below, so a kind's code is written once, whichever generator asks for it. A kind with no
emitter of its own gets the base `Emitter`, which reads and builds it through its own
``children``, ``make``, ``shell``, ``fill`` and ``setter`` (a new kind is one entry in
`kinds.KINDS`, and it works here unchanged).

The generators differ only in where the code goes and what it is called: a `Code` is one
function body being written (its lines, its indent, how its constants are bound in the
namespace, the prefix of its locals). The names a template uses (``M``, ``STRICT``, ``SAME``,
``FOL``, ``new``, ...) are `READ_NAMES` and `BUILD_NAMES`, which the generators bind.

This file decides nothing about sharing: it writes what a GraphDef records.
"""

from __future__ import annotations

import keyword
import operator
from collections.abc import Callable
from typing import Any

from ..kinds import DICT, KINDS, LIST, NAMEDTUPLE, OBJ, PYTREE, SLOTS, TUPLE, VIEW, _pytree_def, _registry
from ..strict import _same_strict, _strict
from ..view import View

# ---------------------------------------------------------------- templates: reading a node
# ``v``: the local holding the node; a failed check raises M (the plan's miss).

CHECK_SAME = "if {expr} is not {known}: raise M"
# a list or a tuple (``{type}``: list, tuple) or a namedtuple (its class, a constant)
CHECK_SEQUENCE = "if type({v}) is not {type} or len({v}) != {n}: raise M"
# a sequence of arrays: all the very arrays read before, or all new, unpacked at once
CHECK_ALL_SAME = "if not all(map(is_, {v}, {known})): raise M"
UNPACK = "{targets}, = {v}"
# a dict whose keys are all str: at once when they are the very keys recorded (a dict tied
# rebuilt, or keyed by the same strings); else equal, and checked exact str here
CHECK_STR_DICT = (
    "if type({v}) is not dict or len({v}) != {n} or (not all(map(is_, {v}, {keys}))"
    " and (tuple({v}) != {keys} or not STR.issuperset(map(type, {v})))): raise M"
)
CHECK_DICT = "if type({v}) is not dict or tuple({v}) != {keys}: raise M"
# other keys: 1 == 1.0 == True, so the keys themselves, type and bits
CHECK_STRICT_KEYS = "if tuple(map(STRICT, {v})) != {strict}: raise M"
READ_VALUES = "{into} = tuple({v}.values())"
READ_VALUES_BY_KEY = "{into} = tuple(map({v}.__getitem__, {keys}))"
CHECK_TYPE = "if type({v}) is not {type}: raise M"
# a node whose children come from a call (a JAX pytree's one level, a kind's own children)
CALL_CHILDREN = "{c}, {a} = {call}({v})"
CHECK_CALLED = "if len({c}) != {n} or not SAME({a}, {meta}, {strict}): raise M"
CHECK_VIEW = "if type({v}) is not View or ({v}.fn is not {fn} and STRICT({v}.fn) != {strict}): raise M"
# an attribute-holding node: its ``__dict__`` (its type and field names checked later, all
# nodes' at once, where the generator collects them; else here, field by field)
READ_DICT = "{d} = {v}.__dict__"
CHECK_NO_FIELDS = "if {d}: raise M"
UNPACK_FIELDS = "{targets}, = {d}"
CHECK_FIELDS = "if {unequal}: raise M"
UNPACK_VALUES = "{targets}, = {d}.values()"

# ---------------------------------------------------------------- templates: writing a node's child
# (a write-back plan: ``value``, a new value ``V[n]`` or a rebuilt container, put at a place read before)
PUT_ITEM = "{child} = {value}"  # the place's reading expression is the item its setter assigns
PUT_BY_SETTER = "{setter}({meta}, {v}, {i})({value})"  # the kind's own setter (a cell checks)

# ---------------------------------------------------------------- templates: a static at its place
STATIC_EXACT = "{s} is not {value} and (type({s}) is not {type} or {s} != {value})"
STATIC_BITS = "{s} is not {value} and (type({s}) is not {type} or STRICT({s}) != {bits})"

# ---------------------------------------------------------------- templates: building a node
# ``y``: the local the node goes in; ``args``: a tuple display of its children.

SHELL_LIST = "{y} = []"
SHELL_DICT = "{y} = {{}}"
SHELL_OBJECT = "{y} = new({type})"
SHELL_KIND = "{y} = {shell}({meta})"
FILL_LIST = "{y}.extend({args})"
FILL_DICT = "{y}.update(zip({keys}, {args}))"
# the keys in the model's order first (from a dict made once: its table copied, no resizing
# as keys are added; a str's hash never changes), then the values
FILL_DICT_KEYS = "{y}.update({keys})"
FILL_DICT_ORDER = "{y}.update(dict.fromkeys({order}))"
FILL_ATTRIBUTE = "{y}.{name} = {value}"  # the fastest way to fill a fresh __dict__
FILL_ATTRIBUTES = "{y}.__dict__.update(zip({names}, {args}))"
FILL_KIND = "{fill}({meta}, {y}, list({args}))"
BUILD_LIST = "{y} = [{items}]"
BUILD_DICT = "{y} = dict(zip({keys}, {args}))"
BUILD_TUPLE = "{y} = {args}"
BUILD_NAMEDTUPLE = "{y} = {type}(*{args})"
BUILD_PYTREE = "{y} = {treedef}.unflatten({args})"
BUILD_VIEW = "{y} = View({source}, {fn})"
BUILD_KIND = "{y} = {make}({meta}, list({args}))"
# ``unflatten(..., materialize=True)``: a view computed; its failure named by `view_failed`
MATERIALIZE = """\
{s} = {source}
try:
 {y} = {materialize}({meta}, [{s}])
except Exception as e:
 raise VF(G, {j}, {meta}, {s}, e) from e"""


class Miss(Exception):
    """The graph differs from the plan's GraphDef (what a failed check raises: ``M``)."""


# The names the templates use, bound in a plan's namespace by its generator: reading
# (flatten and write-back plans), and building (unflatten plans; a materialized view's failure
# is named by ``VF``, `graphdef.view_failed`, given the plan's GraphDef as ``G``).
READ_NAMES: dict[str, Any] = {
    "M": Miss,
    "View": View,
    "STRICT": _strict,
    "SAME": _same_strict,
    "is_": operator.is_,
    "FOL": _registry.flatten_one_level,
    "STR": frozenset((str,)),
}
BUILD_NAMES: dict[str, Any] = {"new": object.__new__, "View": View}


class Code:
    """One function body being written: its ``lines`` (each template line at ``indent``), the
    namer ``const(value, prefix)`` that binds a constant in the namespace and returns its
    name, and the ``prefix`` of the locals an emitter makes (``c{at}``, ``x`` + ``c{at}``).
    ``objects``: where the attribute-holding nodes' checks are collected, to be made at once
    (None: made where each is read)."""

    def __init__(
        self, lines: list[str], indent: str, const: Callable[[Any, str], str], prefix: str = ""
    ) -> None:
        self.lines, self.indent, self.const, self.prefix = lines, indent, const, prefix
        self.objects: list[tuple[str, str, Any, tuple]] | None = None
        self._once: dict = {}

    def emit(self, template: str, **fields: Any) -> None:
        """The lines of ``template`` filled with ``fields``, at this body's indent."""
        text = template.format(**fields) if fields else template
        self.lines.extend(self.indent + line for line in text.split("\n"))

    def local(self, name: str, at: str) -> str:
        """The name of an emitter's local ``name`` for the node ``at`` names."""
        return f"{self.prefix}{name}{at}"

    def once(self, key: Any, value: Any, prefix: str) -> str:
        """``const``, binding ``value`` once in this body for each ``key`` (a kind's function
        used at many places)."""
        name = self._once.get(key)
        if name is None:
            name = self._once[key] = self.const(value, prefix)
        return name


def tup(items: list[str]) -> str:
    """A tuple display of ``items`` (``()`` for none, ``(x, )`` for one)."""
    return "(" + "".join(f"{x}, " for x in items) + ")"


def static_check(s: str, value: Any, const: Callable[[Any, str], str]) -> str:
    """A condition, true when the static read into ``s`` differs from ``value`` (type and bits)."""
    sv, st = const(value, "SV"), const(type(value), "ST")
    if type(value) not in EXACT_EQ:
        return STATIC_BITS.format(s=s, value=sv, type=st, bits=const(_strict(value), "BV"))
    return STATIC_EXACT.format(s=s, value=sv, type=st)


# Statics whose == is exact: the same type and == mean the same value. Any other static that
# is not the very object recorded is compared by its strict key (type and bits; identity
# for the objects whose == is not trusted), as GraphDefs compare.
EXACT_EQ = frozenset({str, int, bool, type(None)})


def dict_order(meta: tuple, refs: tuple) -> tuple[tuple, tuple]:
    """A dict's keys and children in the model's insertion order (which the rebuilt dict keeps)."""
    keys, order = meta
    if order is None:
        return keys, refs
    position = {k: i for i, k in enumerate(keys)}
    return order, tuple(refs[position[k]] for k in order)


# ---------------------------------------------------------------- the emitters, one per kind


class Emitter:
    """How plans read and build one kind of node. ``loops``: whether a loop body may hold it
    (it reads its fields itself, and builds with no call a cycle would need); ``unpacks``:
    its children are its items in order (a sequence of arrays can be unpacked at once)."""

    loops = False
    unpacks = False

    def __init__(self, index: int) -> None:
        self.kind = KINDS[index]

    def read(self, code: Code, v: str, meta: Any, n: int, at: str, bulk: str | None = None) -> list[str]:
        """Emit the checks of the node in local ``v`` (``n`` children); return the expressions
        of its children. ``at`` names its locals; ``bulk``: a local to read all its children
        into in one statement (all arrays seen there first), for a node that does not hold
        them as a sequence does."""
        kind = self.kind  # any kind: its own children(), its meta compared strictly
        t, call = code.const(kind.type_of(meta), "T"), code.const(kind.children, "CH")
        return _read_by_call(code, v, n, at, t, call, meta, ("MT", "SM"))

    def shell(self, code: Code, y: str, meta: Any) -> None:
        """A mutable node, empty (made before its children: a cycle may pass through it)."""
        code.emit(SHELL_KIND, y=y, shell=code.const(self.kind.shell, "SH"), meta=code.const(meta, "M"))

    def fill(
        self, code: Code, y: str, meta: Any, refs: tuple, args: Callable, ref: Callable, bulk: bool = False
    ) -> None:
        """A mutable node's children put in (``args(refs)``: their tuple display; ``ref(r)``:
        one child's expression; ``bulk``: they are all arrays seen there first)."""
        fill, m = code.const(self.kind.fill, "FL"), code.const(meta, "M")
        code.emit(FILL_KIND, fill=fill, meta=m, y=y, args=args(refs))

    def make(self, code: Code, y: str, meta: Any, refs: tuple, args: Callable, ref: Callable) -> None:
        """An immutable node, built from its children."""
        make, m = code.const(self.kind.make, "MK"), code.const(meta, "M")
        code.emit(BUILD_KIND, y=y, make=make, meta=m, args=args(refs))

    def whole(self, code: Code, y: str, meta: Any, refs: tuple, args: Callable, ref: Callable) -> None:
        """A node built at once, its children made before (no cycle passes through it)."""
        self.make(code, y, meta, refs, args, ref)

    def reach(self, code: Code, v: str, meta: Any, n: int, at: str) -> list[str]:
        """The expressions of the children of the node in local ``v``, with no check: a
        write-back plan reaching, once every check has passed, a container a loop read."""
        c, a = code.local("c", at), code.local("a", at)
        code.emit(CALL_CHILDREN, c=c, a=a, call=code.const(self.kind.children, "CH"), v=v)
        return [f"{c}[{k}]" for k in range(n)]

    def put(self, code: Code, v: str, at: str, child: str, meta: Any, i: int, value: str) -> str:
        """Emit the write of ``value`` (an expression) at child ``i`` (read as ``child``) of the
        node in local ``v``; return the local the write goes through (the plan hands it out)."""
        setter = code.once(("setter", self.kind.index), self.kind.setter, "SET")
        code.emit(PUT_BY_SETTER, setter=setter, meta=code.const(meta, "MT"), v=v, i=i, value=value)
        return v

    def materialize(self, code: Code, y: str, j: int, meta: Any, source: str) -> None:
        """Node ``j`` computed from its source (``unflatten(..., materialize=True)``), a failure
        named by `view_failed` (``VF``, the GraphDef in ``G``)."""
        mz, m = code.const(self.kind.materialize, "MZ"), code.const(meta, "M")
        code.emit(MATERIALIZE, s=f"s{j}", source=source, y=y, materialize=mz, meta=m, j=j)


def _read_by_call(
    code: Code, v: str, n: int, at: str, typ: str, call: str, meta: Any, names: tuple
) -> list[str]:
    """A node whose children come from ``call``, checked by type first (the call may run user
    code), then its arity and its meta compared strictly (bound under ``names``)."""
    c, a = code.local("c", at), code.local("a", at)
    code.emit(CHECK_TYPE, v=v, type=typ)
    code.emit(CALL_CHILDREN, c=c, a=a, call=call, v=v)
    expected, strict = code.const(meta, names[0]), code.const(_strict(meta), names[1])
    code.emit(CHECK_CALLED, c=c, n=n, a=a, meta=expected, strict=strict)
    return [f"{c}[{k}]" for k in range(n)]


class _Sequence(Emitter):
    loops = unpacks = True

    def read(self, code, v, meta, n, at, bulk=None):
        code.emit(CHECK_SEQUENCE, v=v, type=self.kind.name, n=n)
        return self.reach(code, v, meta, n, at)

    def reach(self, code, v, meta, n, at):
        return [f"{v}[{k}]" for k in range(n)]

    def shell(self, code, y, meta):
        code.emit(SHELL_LIST, y=y)

    def fill(self, code, y, meta, refs, args, ref, bulk=False):
        code.emit(FILL_LIST, y=y, args=args(refs))

    def put(self, code, v, at, child, meta, i, value):
        if not self.kind.mutable:
            return super().put(code, v, at, child, meta, i, value)
        code.emit(PUT_ITEM, child=child, value=value)
        return v

    def make(self, code, y, meta, refs, args, ref):
        code.emit(BUILD_TUPLE, y=y, args=args(refs))

    def whole(self, code, y, meta, refs, args, ref):
        if self.kind.mutable:
            code.emit(BUILD_LIST, y=y, items=args(refs)[1:-1])
        else:
            self.make(code, y, meta, refs, args, ref)


class _Dict(Emitter):
    loops = True

    def read(self, code, v, meta, n, at, bulk=None):
        keys, order = meta
        ks = code.const(keys, "K")
        inserted = code.const(keys if order is None else order, "KI")
        str_keys = all(type(k) is str for k in keys)
        if n and str_keys:
            code.emit(CHECK_STR_DICT, v=v, n=n, keys=inserted)
        else:
            code.emit(CHECK_DICT, v=v, keys=inserted)
        if bulk is not None:
            code.emit(READ_VALUES if order is None else READ_VALUES_BY_KEY, into=bulk, v=v, keys=ks)
        if not str_keys:
            strict = code.const(tuple(map(_strict, keys if order is None else order)), "SK")
            code.emit(CHECK_STRICT_KEYS, v=v, strict=strict)
        return [f"{v}[{ks}[{k}]]" for k in range(n)]

    def reach(self, code, v, meta, n, at):
        ks = code.const(meta[0], "K")
        return [f"{v}[{ks}[{k}]]" for k in range(n)]

    def shell(self, code, y, meta):
        code.emit(SHELL_DICT, y=y)

    def put(self, code, v, at, child, meta, i, value):
        code.emit(PUT_ITEM, child=child, value=value)
        return v

    def fill(self, code, y, meta, refs, args, ref, bulk=False):
        keys, order = meta
        if len(refs) > 8 and all(type(k) is str for k in keys):
            inserted = code.const(dict.fromkeys(keys if order is None else order), "KD")
            code.emit(FILL_DICT_KEYS, y=y, keys=inserted)
        elif order is not None and bulk:
            code.emit(FILL_DICT_ORDER, y=y, order=code.const(order, "KI"))
        else:  # fill in the model's insertion order
            keys, refs = dict_order(meta, refs)
        code.emit(FILL_DICT, y=y, keys=code.const(keys, "K"), args=args(refs))

    def whole(self, code, y, meta, refs, args, ref):
        keys, refs = dict_order(meta, refs)
        code.emit(BUILD_DICT, y=y, keys=code.const(keys, "K"), args=args(refs))


class _NamedTuple(Emitter):
    loops = True

    def read(self, code, v, meta, n, at, bulk=None):
        code.emit(CHECK_SEQUENCE, v=v, type=code.const(meta, "T"), n=n)
        return self.reach(code, v, meta, n, at)

    def reach(self, code, v, meta, n, at):
        return [f"{v}[{k}]" for k in range(n)]

    def make(self, code, y, meta, refs, args, ref):
        code.emit(BUILD_NAMEDTUPLE, y=y, type=code.const(meta, "T"), args=args(refs))


class _Pytree(Emitter):
    loops = True

    def read(self, code, v, meta, n, at, bulk=None):
        return _read_by_call(code, v, n, at, code.const(meta[0], "T"), "FOL", meta[1], ("AUX", "SAUX"))

    def make(self, code, y, meta, refs, args, ref):
        treedef = code.const(_pytree_def(meta, len(refs)), "P")
        code.emit(BUILD_PYTREE, y=y, treedef=treedef, args=args(refs))


class _Object(Emitter):
    """A node whose children are its ``__dict__`` values (a registered class, a state cell)."""

    loops = True

    def read(self, code, v, meta, n, at, bulk=None):
        d = code.local("d", at)
        if code.objects is not None:  # its type and field names checked with all the others
            code.objects.append((v, d, meta[0], meta[1]))
            return self.reach(code, v, meta, n, at)
        code.emit(CHECK_TYPE, v=v, type=code.const(meta[0], "T"))
        code.emit(READ_DICT, d=d, v=v)
        if not n:
            code.emit(CHECK_NO_FIELDS, d=d)
            return []
        keys = [code.local("k", f"{at}_{i}") for i in range(n)]
        code.emit(UNPACK_FIELDS, targets=", ".join(keys), d=d)
        names = [code.const(name, "FN") for name in meta[1]]
        code.emit(CHECK_FIELDS, unequal=" or ".join(f"{a} != {b}" for a, b in zip(keys, names)))
        values = [code.local("v", f"{at}_{i}") for i in range(n)]
        code.emit(UNPACK_VALUES, targets=", ".join(values), d=d)
        return values

    def reach(self, code, v, meta, n, at):
        d = code.local("d", at)
        code.emit(READ_DICT, d=d, v=v)
        return [f"{d}[{name!r}]" for name in meta[1]]

    def shell(self, code, y, meta):
        code.emit(SHELL_OBJECT, y=y, type=code.const(meta[0], "T"))

    def put(self, code, v, at, child, meta, i, value):
        if type(self.kind).setter is not type(KINDS[OBJ]).setter:  # its own (a state cell's)
            return super().put(code, v, at, child, meta, i, value)
        code.emit(PUT_ITEM, child=child, value=value)  # an item of its __dict__, read in d{at}
        return code.local("d", at)

    def fill(self, code, y, meta, refs, args, ref, bulk=False):
        if plain_attributes(meta[0], meta[1]):
            for name, r in zip(meta[1], refs):
                code.emit(FILL_ATTRIBUTE, y=y, name=name, value=ref(r))
        else:
            code.emit(FILL_ATTRIBUTES, y=y, names=code.const(tuple(meta[1]), "N"), args=args(refs))

    def whole(self, code, y, meta, refs, args, ref):
        self.shell(code, y, meta)
        self.fill(code, y, meta, refs, args, ref)


class _Slots(Emitter):
    """A dataclass with slots: made empty as an object is, read and filled by its kind."""

    def shell(self, code, y, meta):
        code.emit(SHELL_OBJECT, y=y, type=code.const(meta[0], "T"))


class _View(Emitter):
    def read(self, code, v, meta, n, at, bulk=None):
        fn, strict = code.const(meta, "FN"), code.const(_strict(meta), "SFN")
        code.emit(CHECK_VIEW, v=v, fn=fn, strict=strict)
        return self.reach(code, v, meta, n, at)

    def reach(self, code, v, meta, n, at):
        return [f"{v}.source"]

    def make(self, code, y, meta, refs, args, ref):
        code.emit(BUILD_VIEW, y=y, source=ref(refs[0]), fn=code.const(meta, "F"))


# The table: the emitter of each kind, by its index. A kind not named here is read and built
# through its own methods (`Emitter`); one whose children are its ``__dict__`` as an object.
_SPECIAL = {LIST: _Sequence, TUPLE: _Sequence, DICT: _Dict, NAMEDTUPLE: _NamedTuple, PYTREE: _Pytree}
_SPECIAL |= {VIEW: _View, SLOTS: _Slots}
EMITTERS: tuple[Emitter, ...] = tuple(
    _SPECIAL.get(k.index, _Object if k.fields_in_dict else Emitter)(k.index) for k in KINDS
)
# The kinds a loop body may hold.
LOOP_KINDS = frozenset(k for k, e in enumerate(EMITTERS) if e.loops)


def plain_attributes(cls: type, names: tuple) -> bool:
    """Whether ``obj.name = value`` on a fresh instance only stores into its ``__dict__``:
    no custom ``__setattr__`` (frozen dataclasses have one), no descriptor of that name."""
    if getattr(cls, "__setattr__", None) is not object.__setattr__:
        return False
    for name in names:
        if not (isinstance(name, str) and name.isidentifier()) or keyword.iskeyword(name):
            return False
        if name.startswith("__"):
            return False
        if hasattr(type(getattr(cls, name, None)), "__set__"):
            return False
    return True
