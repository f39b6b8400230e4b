"""Surgery on ambiguous paths and on graphs with parent back-references (issue 17, points 7 and 9)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import tied


@tied.register
class Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_replace_on_a_path_two_places_write_alike_is_refused_naming_both():
    inner = Obj(b=jnp.zeros(2))
    o = Obj(a=inner)
    setattr(o, "a.b", jnp.ones(2))  # an attribute literally named "a.b", written .a.b too
    for who, call in [
        ("tied.replace", lambda: tied.replace(o, ".a.b", jnp.full(2, 5.0))),
        ("tied.untie", lambda: tied.untie(o, ".a.b")),
        ("tied.tie", lambda: tied.tie(o, ".a.b", ".a")),
    ]:
        with pytest.raises(
            ValueError,
            match=rf"{who}: \.a\.b names 2 places of the model, whose keys .* are "
            r"(\('\.a\.b'\) and \('\.a', '\.b'\)|\('\.a', '\.b'\) and \('\.a\.b'\))",
        ):
            call()
    np.testing.assert_array_equal(np.asarray(inner.b), np.zeros(2))  # nothing was edited
    np.testing.assert_array_equal(np.asarray(getattr(o, "a.b")), np.ones(2))


def back_referenced():
    root = Obj(w=jnp.ones(2), kids=[])
    kid = Obj(parent=root, v=jnp.arange(2.0))
    root.kids.append(kid)
    return root, kid


def test_untie_an_array_in_a_graph_with_parent_back_references():
    root, kid = back_referenced()
    root.shared = kid.v  # v at two places: .kids[0].v and .shared
    out = tied.untie(root, ".kids[0].v")
    assert out.kids[0].parent is out  # the back-reference still reaches the new root
    assert out.shared is kid.v and out.kids[0].v is not kid.v
    np.testing.assert_array_equal(np.asarray(out.kids[0].v), np.arange(2.0))
    assert root.kids[0].v is kid.v  # the model given is not changed


def test_untie_a_container_that_reaches_its_parent_is_refused_with_a_fix_that_works():
    root, kid = back_referenced()
    root.again = kid.v
    with pytest.raises(
        ValueError,
        match=r"the container at \.kids\[0\] reaches <root> again at "
        r"\.kids\[0\]\.parent .* Untie the arrays inside it",
    ):
        tied.untie(root, ".kids[0]")
    out = tied.untie(root, ".kids[0].v")  # the fix the message gives
    assert out.kids[0].v is not out.again and out.kids[0].parent is out


def test_untie_below_a_truly_shared_container_still_names_the_container():
    root, kid = back_referenced()
    root.kids.append(kid)  # the kid at two places
    with pytest.raises(ValueError, match=r"lies inside \.kids\[0\], a container shared with \.kids\[1\]"):
        tied.untie(root, ".kids[0].v")
