"""Checks of values known only when a compiled program runs (a cache position), raised loudly.

A layer that must refuse a value it cannot see at trace time (a `KVCache` written past its end,
which JAX would clamp onto its last rows: a wrong answer that raises nothing) calls
`check(bad, fail, *operands)`: ``fail(bad, *operands)`` raises when ``bad`` holds anywhere.

* Concrete values (eager code): checked at once.
* Traced by `tied.jit` itself (the function's own trace, not a body of a transform inside it):
  ``bad`` and the operands become outputs of the compiled program, and `tied.jit` calls ``fail``
  on their values after the call, before anything is written back. The program holds no host
  callback, so JAX keeps its C++ dispatch path (a callback in a decode step made a 64-token
  decode 4.5x the hand-written one: every call went through Python dispatch).
* In a `tied.scan`, `tied.vmap` or `tied.remat` body: carried out as one flag per step or
  example, and checked around it (under `tied.jit`, after the call; eagerly, when it returns).
* On the parameters' tracers in a `tied.grad` loss or a `tied.gradient` function: carried out
  beside the aux, and checked when the gradient returns (under `tied.jit`, after its call).
* A check is carried out by the innermost of those whose trace made its values, the others of
  traces around it (a cache's position, of `tied.jit`'s trace, checked in a `tied.grad` loss
  under it is `tied.jit`'s; with the loss's value as an operand, the gradient's).
* Anywhere else in a traced program (`jax.jit`, `jax.vmap`, `jax.lax.scan`): a host callback
  inside a ``cond``, called only when ``bad`` holds (batched under ``vmap``: ``fail`` looks at
  every example), as Equinox's ``error_if`` does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .escapes import first_trace, trace_of

__all__ = ["CheckScope", "check", "check_scope", "run_checks"]

_scopes = threading.local()


class CheckScope:
    """The checks made in one `tied.jit` trace: for each, ``(fail, number of operands)``, and the
    flags and operands to return from the program (``values``)."""

    __slots__ = ("trace", "checks", "values")

    def __init__(self, trace: Any):
        self.trace = trace
        self.checks: list[tuple[Callable[..., None], int]] = []
        self.values: list = []


@contextlib.contextmanager
def check_scope(leaves: list):
    """Open the scope of a `tied.jit` trace whose input arrays are ``leaves`` (its tracers)."""
    stack = _scopes.__dict__.setdefault("stack", [])
    scope = CheckScope(first_trace(leaves))
    stack.append(scope)
    try:
        yield scope
    finally:
        stack.pop()


def check(bad: Any, fail: Callable[..., None], *operands: Any) -> None:
    """Have ``fail(bad, *operands)`` called on the values of ``bad`` and ``operands``: at once when
    they are concrete, after the call under `tied.jit`, else from the running program (see the
    module). ``fail`` raises when ``bad`` holds anywhere and returns otherwise."""
    if not any(isinstance(x, jax.core.Tracer) for x in (bad, *operands)):
        fail(np.asarray(bad), *(np.asarray(x) for x in operands))
        return
    if not isinstance(bad, jax.core.Tracer) and not np.any(bad):  # known now to hold nowhere
        return
    scope = _scope_of([bad, *operands])
    if scope is not None:
        scope.checks.append((fail, len(operands)))
        scope.values.extend([jnp.asarray(bad), *operands])  # whole: `fail` names the first bad one
        return
    jax.lax.cond(
        jnp.any(bad),
        lambda b, *xs: jax.debug.callback(fail, b, *xs),
        lambda b, *xs: None,
        bad,
        *operands,
    )


def _scope_of(values: list) -> CheckScope | None:
    """The innermost open scope whose trace made one of ``values``, if every other traced value
    is of its trace or of a scope around it (a value the body closes over): the flags and
    operands are then values its transform can return. (Under `tied.grad` a comparison of the
    parameters' tracers is concrete: the loss's value, an operand, says whose check it is.)"""
    traces = {id(t) for t in map(trace_of, values) if t is not None}
    stack = getattr(_scopes, "stack", ())
    for k in range(len(stack) - 1, -1, -1):
        if id(stack[k].trace) in traces:
            around = {id(c.trace) for c in stack[: k + 1]}
            return stack[k] if traces <= around else None
    return None


def run_checks(checks: tuple, values: list) -> None:
    """After a `tied.jit` call: call each check's ``fail`` on the values the program returned
    (``values``: each check's flag then its operands), before anything is written back. Under
    another transform (the values are tracers), the checks are made again at its level."""
    at = 0
    for fail, n in checks:
        flag, operands = values[at], values[at + 1 : at + 1 + n]
        at += 1 + n
        if any(isinstance(x, jax.core.Tracer) for x in (flag, *operands)):
            check(flag, fail, *operands)
        elif np.any(flag):  # a flag per step where a tied.scan carried them out
            fail(np.asarray(flag), *(np.asarray(x) for x in operands))
