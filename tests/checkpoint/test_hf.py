"""GPT-2 from and back to ``transformers`` itself: a random ``GPT2LMHeadModel`` is the reference.

Every value is compared with what PyTorch's own model computes (logits, the tied
embedding's gradient, which PyTorch accumulates over both uses of the one Parameter).
``transformers`` is slow to import, so every test here shares the module's fixtures.
Nothing is downloaded: the configurations are random and tiny.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors

import tied

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt2_from_transformers.py"
SHARD = "12KB"  # the 2-layer width-32 model is 112 kB: about 10 shards
IDS = np.array([[1, 5, 9, 2, 7, 63, 0, 11], [4, 4, 8, 30, 2, 1, 60, 3]])


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("gpt2_from_transformers", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_gpt2(seed: int = 0):
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # larger than GPT-2's 0.02 init, so that a wrong map shows in the logits
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def torch_logits(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A random GPT2LMHeadModel and the directory ``save_pretrained`` wrote it to, sharded."""
    model = random_gpt2()
    d = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(d, max_shard_size=SHARD)
    return model, d


@pytest.fixture(scope="module")
def loaded(example, pretrained):
    return example.load_gpt2(str(pretrained[1]))


def test_save_pretrained_gave_a_sharded_set_without_the_head(pretrained):
    _, d = pretrained
    wmap = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(wmap.values())) >= 3
    assert "lm_head.weight" not in wmap and "transformer.wte.weight" in wmap


def test_load_gpt2_gives_pytorchs_logits_with_the_head_tied(pretrained, loaded):
    model, _ = pretrained
    assert loaded.head.weight is loaded.wte.weight
    assert tied.ties(loaded) == [(".wte.weight", ".head.weight")]
    np.testing.assert_allclose(
        np.asarray(loaded(jnp.asarray(IDS))), torch_logits(model), atol=1e-4, rtol=1e-4
    )


def test_one_grad_step_gives_the_tied_weight_pytorchs_total_gradient(pretrained, loaded):
    model, _ = pretrained
    targets = np.roll(IDS, -1, axis=1)

    def loss(m):
        logp = jax.nn.log_softmax(m(jnp.asarray(IDS)), axis=-1)
        return -jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1).mean()

    g = tied.grad(loss)(loaded)
    assert g.head.weight is g.wte.weight  # one total, aliased at both places
    model.zero_grad()
    logits = model(torch.tensor(IDS)).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), torch.tensor(targets).reshape(-1)).backward()
    # PyTorch's one Parameter sums the gradients of both uses: the independent total.
    np.testing.assert_allclose(
        np.asarray(g.wte.weight), model.transformer.wte.weight.grad.numpy(), atol=1e-5, rtol=1e-4
    )
    c_attn = model.transformer.h[1].attn.c_attn.weight.grad.numpy()  # Conv1D: (in, out)
    np.testing.assert_allclose(np.asarray(g.blocks[1].attn.qkv.weight), c_attn.T, atol=1e-5, rtol=1e-4)
    model.zero_grad()


def test_save_gpt2_is_read_back_by_from_pretrained(example, pretrained, loaded, tmp_path):
    model, _ = pretrained
    (tmp_path / "README.md").write_text("kept")
    example.save_gpt2(loaded, str(tmp_path), max_shard_size=SHARD)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and "lm_head.weight" not in index["weight_map"]
    for shard in shards:
        with safetensors.safe_open(tmp_path / shard, "np") as f:
            assert f.metadata() == {"format": "pt"} and "lm_head.weight" not in f.keys()
    back, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    back.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert back.lm_head.weight is back.transformer.wte.weight
    np.testing.assert_allclose(torch_logits(back), torch_logits(model), atol=1e-4, rtol=1e-4)
    for name, p in model.state_dict().items():  # every weight back bit for bit
        assert torch.equal(back.state_dict()[name], p), name
    assert (tmp_path / "README.md").read_text() == "kept"
    # Read back by tied strictly: the manifest restores the tie, the inverse transform the layout.
    strict = tied.load(tmp_path, loaded, transform={p: (lambda a: a.T) for p in example.conv1d_places(2)})
    assert strict.head.weight is strict.wte.weight
    np.testing.assert_array_equal(
        np.asarray(strict.blocks[0].mlp.fc1.weight), np.asarray(loaded.blocks[0].mlp.fc1.weight)
    )


def test_a_bfloat16_checkpoint_loads_into_float32_with_dtype_like(example, pretrained, tmp_path):
    model, _ = pretrained
    half = random_gpt2().to(torch.bfloat16)
    half.save_pretrained(tmp_path, max_shard_size=SHARD)
    with pytest.raises(
        tied.CheckpointError,
        match=r"dtype differs at .wte.weight: the file has \(64, 32\) bfloat16, like has \(64, 32\) float32",
    ):
        example.load_gpt2(str(tmp_path))
    back = example.load_gpt2(str(tmp_path), dtype="like")
    assert back.head.weight is back.wte.weight and back.wte.weight.dtype == jnp.float32
    want = half.transformer.wte.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(back.wte.weight), want)
    qkv = half.transformer.h[0].attn.c_attn.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(back.blocks[0].attn.qkv.weight), qkv.T)


def test_a_single_file_save_pretrained_directory_loads_too(example, pretrained, tmp_path):
    model, _ = pretrained
    model.save_pretrained(tmp_path)  # fits one file: model.safetensors, no index
    assert "model.safetensors" in os.listdir(tmp_path)
    back = example.load_gpt2(str(tmp_path))
    assert back.head.weight is back.wte.weight
    np.testing.assert_allclose(np.asarray(back(jnp.asarray(IDS))), torch_logits(model), atol=1e-4, rtol=1e-4)


def test_the_example_runs(example):
    r = example.main()
    assert r["tied"] and r["same"] and "model.safetensors.index.json" in r["files"]
