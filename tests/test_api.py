"""The public surface: what `dir()` shows a user of each public module."""

import pytest

import tied


@pytest.mark.parametrize("module", [tied, tied.nn, tied.optim], ids=["tied", "tied.nn", "tied.optim"])
def test_dir_of_every_public_module_lists_only_its_public_names(module):
    shown = set(dir(module))
    assert shown == set(module.__all__)
    assert not {"Any", "Callable", "jax", "jnp", "np", "View"} & (shown - set(module.__all__))
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_new_public_names_are_exported():
    for name in (
        "State",
        "Rng",
        "register_state",
        "is_state",
        "CheckpointManager",
        "under",
        "block_until_ready",
    ):
        assert name in tied.__all__ and hasattr(tied, name)
    for name in ("BatchNorm", "Dropout", "Conv2d", "RMSNorm", "KVCache", "mode"):
        assert name in tied.nn.__all__


def test_grad_with_a_trainable_that_selects_nothing_warns_naming_nnx_paths():
    import jax.numpy as jnp

    model = {"block": {"kernel": jnp.ones(2)}}
    with pytest.warns(UserWarning, match=r"tied.grad: trainable=.* selects none of the model's 1 param"):
        g = tied.grad(lambda m: m["block"]["kernel"].sum(), trainable=lambda k, x: k.endswith("kern"))(model)
    assert g["block"]["kernel"] is None
