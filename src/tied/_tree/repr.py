"""Models that print themselves: a tree of fields with array shapes, every tie marked.

``repr(model)`` of a class given to `tied.register` (and of every `tied.nn` layer) reads the
model through the one walk (`tied.flatten`'s `GraphDef` and `GraphDef.walk_places`), as the
summary table does, so it marks exactly the ties the rest of the library acts on. An encoder and
a decoder that uses its weight transposed
(``tied.tree_repr({"enc": d, "dec": Dense(tied.transpose(d.weight))})``)::

    {
      'dec': Dense(
        weight=View(
          fn=<function transpose>,
          source=f32[4,8],
        ),
        bias=None,
        activation=None,
      ),
      'enc': Dense(
        weight=<tied: same as ['dec'].weight.source>,
        bias=f32[4],
        activation=None,
      ),
    }

One line per field; an array is its dtype and shape (``f32[2,2]``, as Equinox prints it;
``(numpy)`` marks a NumPy array); a later place of a shared array or node, a reference back
to a node above (a cycle) included, is ``<tied: same as PATH>`` and is not expanded again.
Past `MAX_LINES` lines or `MAX_DEPTH` levels the rest is elided (``...``), so a model of any
size prints at once: only the places shown are visited. `tied.summary` keeps the full table.

Which classes get it: `register` installs it on a class that has no ``__repr__`` of its own.
A ``__repr__`` written in the class (or a base other than ``object``, ``list`` or ``dict``)
is kept. A dataclass's generated ``__repr__`` is not the author's own: it would print every
array's values and no tie, so it is replaced too (``@dataclass(repr=False)`` is the same);
write a ``__repr__`` to keep your own.

With ``treescope`` installed, ``treescope.render_to_text(model)`` (and its notebook display)
works on these classes through ``__treescope_repr__``, the extension method treescope
documents, and shows the same marks: arrays are rendered by treescope itself, each later
place of a shared object as ``<tied: same as PATH>``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import numpy as np

from .._core import flatten, live_lock
from .._core import register as _register

__all__ = ["register", "tree_repr", "MAX_LINES", "MAX_DEPTH"]

MAX_LINES = 200  # lines of fields shown before the rest is elided
MAX_DEPTH = 24  # nesting levels shown; deeper nodes show as ``Type(...)``
_PATH_CAP = 80  # a reference's path past this many characters shows as "..." and its tail
_STATIC_CAP = 60  # a static value's repr past this many characters is cut


def register(cls: type) -> type:
    """Let `tied` walk instances of a plain Python class, and give it a repr that shows its ties.

    Fields are the ``__dict__`` entries in assignment order (and the ``__slots__``
    that are set). Instances are rebuilt without calling ``__init__``, so any
    constructor signature works. Usable as a class decorator. A registered class
    is a `tied` node, not a JAX pytree: plain JAX functions refuse it with a
    `TypeError` naming the tied way (`tied.grad`, `tied.jit`, `tied.map`,
    ``tied.Graph(model)``), since walking it leaf by leaf would cut its ties.

    Unless the class has a ``__repr__`` of its own, ``repr`` shows its fields as a
    tree (array dtypes and shapes; a later place of a shared object as
    ``<tied: same as PATH>``; see ``src/tied/_repr.py``), and treescope renders it
    with the same marks.

    Args:
        cls: the class to walk.

    Returns:
        ``cls`` itself.

    Raises:
        TypeError: ``cls`` is not a class, or is a kind of object `tied` cannot
            rebuild (a tuple subclass other than a namedtuple, a set, a deque).

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> @tied.register
        ... class Dense:
        ...     def __init__(self, weight, bias):
        ...         self.weight, self.bias = weight, bias
        >>> d1 = Dense(jnp.ones((2, 2)), jnp.zeros(2))
        >>> d2 = Dense(d1.weight, d1.bias)                      # tied by reference
        >>> tied.ties([d1, d2])
        [('[0].weight', '[1].weight'), ('[0].bias', '[1].bias')]
        >>> [d1, d2]   # a plain list of registered objects: each prints on its own
        [Dense(
          weight=f32[2,2],
          bias=f32[2],
        ), Dense(
          weight=f32[2,2],
          bias=f32[2],
        )]
        >>> @tied.register
        ... class Pair:
        ...     def __init__(self, a, b):
        ...         self.a, self.b = a, b
        >>> Pair(d1, d2)
        Pair(
          a=Dense(
            weight=f32[2,2],
            bias=f32[2],
          ),
          b=Dense(
            weight=<tied: same as .a.weight>,
            bias=<tied: same as .a.bias>,
          ),
        )
    """
    cls = _register(cls)
    if not _has_own_repr(cls):
        cls.__repr__ = _repr_method
    if "__treescope_repr__" not in cls.__dict__ and not hasattr(cls, "__treescope_repr__"):
        cls.__treescope_repr__ = _treescope_repr
    return cls


def _has_own_repr(cls: type) -> bool:
    """Whether ``cls`` has a ``__repr__`` someone wrote for it (not object's, list's, dict's,
    a dataclass's generated one or this module's)."""
    owner = next(c for c in cls.__mro__ if "__repr__" in c.__dict__)
    fn = owner.__dict__["__repr__"]
    if owner in (object, list, dict) or fn is _repr_method:
        return False
    code = getattr(inspect.unwrap(fn), "__code__", None)
    generated = code is not None and code.co_filename == "<string>"  # dataclasses exec their methods
    return not (dataclasses.is_dataclass(owner) and generated)


def _repr_method(self: Any) -> str:
    try:
        return tree_repr(self)
    except Exception as e:  # noqa: BLE001 - a repr must not raise; it says why it fell back
        return f"<{type(self).__name__} object at {id(self):#x} (tied cannot walk it: {str(e)[:200]})>"


# ---------------------------------------------------------------- reading a place


_KIND_PREFIX = {"f": "f", "i": "i", "u": "u", "c": "c"}


def _dtype(x: Any) -> str:
    """``f32``, ``i32``, ``bf16``, ``bool``, ``key<fry>``: Equinox's short dtype names."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return str(x.dtype)
    dt = np.dtype(x.dtype)
    if dt.kind == "b":
        return "bool"
    if dt.name == "bfloat16":
        return "bf16"
    prefix = _KIND_PREFIX.get(dt.kind)
    return f"{prefix}{dt.itemsize * 8}" if prefix else dt.name


def array_text(x: Any) -> str:
    """``f32[2,3]``: an array as the repr shows it (``(numpy)`` after a NumPy array)."""
    shape = ",".join(str(d) for d in x.shape)
    return f"{_dtype(x)}[{shape}]" + ("(numpy)" if isinstance(x, np.ndarray) else "")


def _static_text(value: Any) -> str:
    if callable(value) and hasattr(value, "__name__") and not isinstance(value, type):
        return f"<function {value.__name__}>"
    text = repr(value)
    return text if len(text) <= _STATIC_CAP else text[: _STATIC_CAP - 3] + "..."


def _label(key: Any) -> str:
    """What precedes a child's value: ``name=`` for a field, ``'k': `` for a dict key, nothing in
    a sequence."""
    if key is None:
        return ""
    if isinstance(key, jax.tree_util.GetAttrKey):
        return f"{key.name}="
    if isinstance(key, jax.tree_util.DictKey):
        return f"{key.key!r}: "
    if isinstance(key, jax.tree_util.SequenceKey):
        return ""
    return f"{jax.tree_util.keystr((key,))}="


def _shown_path(path: str) -> str:
    path = path or "<root>"
    return path if len(path) <= _PATH_CAP else "..." + path[-(_PATH_CAP - 3) :]


def tie_text(first_path: str) -> str:
    """The mark at a later place of a shared object: ``<tied: same as .layers[0].weight>``."""
    return f"<tied: same as {_shown_path(first_path)}>"


_BRACKETS = {"list": ("[", "]"), "tuple": ("(", ")"), "dict": ("{", "}")}


def _brackets(kind: str, typ: type) -> tuple[str, str]:
    return _BRACKETS.get(kind) or (f"{getattr(typ, '__name__', kind)}(", ")")


def _layout_fields(layouts: dict, j: int) -> list[tuple[str, Any]]:
    """The plain numbers of node ``j``'s layout (`GraphDef.layouts`: a `tied.Stack`'s ``n``),
    shown as fields before its children; longer parts (the stacked places) are left to
    `tied.summary`."""
    layout = layouts.get(j)
    if not isinstance(layout, dict):
        return []
    return [(k, v) for k, v in layout.items() if isinstance(v, int) and not isinstance(v, bool)]


def _obj(p: Any) -> tuple[str, int]:
    return (p.kind, p.index) if p.kind in ("array", "static") else ("node", p.index)


# ---------------------------------------------------------------- the text


def tree_repr(model: Any, *, max_lines: int = MAX_LINES, max_depth: int = MAX_DEPTH) -> str:
    """The model as a tree of fields, one line per field, every tie marked (see the module).

    Args:
        model: any graph `tied.flatten` accepts.
        max_lines: lines shown before the rest is elided (``...``).
        max_depth: nesting levels shown; a node deeper than this shows as ``Type(...)``.

    Returns:
        The text. Only the places shown are visited (the walk stops at the limit).

    Examples:
        >>> import jax.numpy as jnp, tied
        >>> w = jnp.ones((2, 3))
        >>> print(tied.tree_repr({"enc": w, "dec": [w, jnp.zeros(3, jnp.int32)]}))
        {
          'dec': [
            f32[2,3],
            i32[3],
          ],
          'enc': <tied: same as ['dec'][0]>,
        }
    """
    with live_lock:  # not while a write into live models is in progress
        leaves, gdef = flatten(model)
    layouts = dict(gdef.layouts())
    lines: list[str] = []
    first: dict[tuple[str, int], str] = {}
    open_nodes: list[tuple[int, str]] = []  # (depth, closing bracket) of the nodes entered
    hidden_below = None  # the depth of a node shown as Type(...): its places are not shown
    truncated = False
    for p in gdef.walk_places():
        if hidden_below is not None:
            if p.depth > hidden_below:
                first.setdefault(_obj(p), p.path)
                continue
            hidden_below = None
        while open_nodes and open_nodes[-1][0] >= p.depth:
            depth, close = open_nodes.pop()
            lines.append("  " * depth + close + ("," if depth else ""))
        if len(lines) >= max_lines:
            truncated = True
            break
        obj = _obj(p)
        indent, label = "  " * p.depth, _label(p.key)
        comma = "," if p.depth else ""
        if not p.first and obj[0] != "static":
            lines.append(f"{indent}{label}{tie_text(first[obj])}{comma}")
            continue
        first.setdefault(obj, p.path)
        if p.kind == "array":
            lines.append(f"{indent}{label}{array_text(leaves[p.index])}{comma}")
        elif p.kind == "static":
            lines.append(f"{indent}{label}{_static_text(p.value)}{comma}")
        else:
            opening, closing = _brackets(p.kind, p.type)
            if not gdef.children(p.index) and p.value is None:
                lines.append(f"{indent}{label}{opening}{closing}{comma}")
            elif p.depth >= max_depth:
                lines.append(f"{indent}{label}{opening}...{closing}{comma}")
                hidden_below = p.depth
            else:
                lines.append(f"{indent}{label}{opening}")
                if p.value is not None:  # a view's function
                    lines.append(f"{indent}  fn={_static_text(p.value)},")
                for k, v in _layout_fields(layouts, p.index):  # a Stack's length
                    lines.append(f"{indent}  {k}={v},")
                open_nodes.append((p.depth, closing))
    if truncated:
        depth = open_nodes[-1][0] + 1 if open_nodes else 1
        note = f"... (more than {max_lines} lines: tied.summary(model) lists every place)"
        lines.append("  " * depth + note)
    while open_nodes:
        depth, close = open_nodes.pop()
        lines.append("  " * depth + close + ("," if depth else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------- treescope


class _Tie:
    """A later place of a shared object, as treescope shows it (by this repr)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        from treescope import rendering_parts  # only reached from inside treescope

        line = rendering_parts.abbreviation_color(rendering_parts.text(self.text))
        return rendering_parts.build_one_line_tree_node(line, path)


class _Fields:
    """A node of the model for treescope: its type and its fields, read from the walk."""

    def __init__(self, typ: type, fields: dict):
        self.type, self.fields = typ, fields

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        from treescope import repr_lib  # only reached from inside treescope

        return repr_lib.render_object_constructor(
            object_type=self.type, attributes=self.fields, path=path, subtree_renderer=subtree_renderer
        )


class _Node:
    """A node met by the walk, its children gathered in order (turned into `_Fields` or a
    plain list, tuple or dict once the walk is done)."""

    __slots__ = ("kind", "type", "items")

    def __init__(self, kind: str, typ: type, items: list):
        self.kind, self.type, self.items = kind, typ, items


def treescope_view(model: Any) -> Any:
    """The model as plain lists, tuples and dicts of arrays, statics, `_Fields` nodes and `_Tie`
    marks, read from the walk: what treescope renders for a tied node."""
    with live_lock:
        leaves, gdef = flatten(model)
    first: dict[tuple[str, int], str] = {}
    built: dict[int, _Node] = {}
    root = None
    for p in gdef.walk_places():
        obj = _obj(p)
        if not p.first and obj[0] != "static":
            value: Any = _Tie(tie_text(first[obj]))
        else:
            first.setdefault(obj, p.path)
            if p.kind == "array":
                value = leaves[p.index]
            elif p.kind == "static":
                value = p.value
            else:
                fn = [("fn", p.value)] if p.value is not None else []  # a view's function
                value = built[p.index] = _Node(p.kind, p.type, fn)
        if p.parent < 0:
            root = value
        else:
            built[p.parent].items.append((p.key, value))
    return _finish(root)


def _finish(value: Any) -> Any:
    if not isinstance(value, _Node):
        return value
    children = [(key, _finish(v)) for key, v in value.items]
    if value.kind == "list":
        return [v for _, v in children]
    if value.kind == "tuple":
        return tuple(v for _, v in children)
    if value.kind == "dict":
        return {key.key: v for key, v in children}
    fields = {(k if isinstance(k, str) else _label(k).rstrip("=").rstrip(": ")): v for k, v in children}
    return _Fields(value.type, fields)


def _treescope_repr(self: Any, path: str | None, subtree_renderer: Any) -> Any:
    view = treescope_view(self)
    if isinstance(view, _Fields):
        return view.__treescope_repr__(path, subtree_renderer)
    return subtree_renderer(view, path=path)
