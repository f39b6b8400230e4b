"""Fixtures of the checkpoint tests."""

import asyncio

import orbax.checkpoint as ocp
import pytest


@pytest.fixture
def slow_writes(monkeypatch):
    """Orbax's background writes of numpy and JAX arrays start 2 s late, so the caller's next steps
    surely run while the save is in flight (without this, a small save could finish first and hide a
    race). 0.5 s was once not enough: on the busy 2-core machine under pytest -n 2 the test's own
    thread waited longer than that between a save and its next line."""
    from orbax.checkpoint._src.serialization import jax_array_handlers

    def delayed(fn):
        async def late(*args, **kwargs):
            await asyncio.sleep(2.0)
            return await fn(*args, **kwargs)

        return late

    monkeypatch.setattr(
        ocp.type_handlers.NumpyHandler,
        "_background_serialize",
        delayed(ocp.type_handlers.NumpyHandler._background_serialize),
    )
    monkeypatch.setattr(
        jax_array_handlers,
        "_async_serialize_replica_slices",
        delayed(jax_array_handlers._async_serialize_replica_slices),
    )
