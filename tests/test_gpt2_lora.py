"""LoRA on a tied GPT-2 against ``transformers`` and ``peft`` themselves (examples/gpt2_lora.py).

A random ``GPT2LMHeadModel`` (2 layers, nothing downloaded) is the base; peft's own
``PeftModel`` reads tied's adapter files and writes the files tied reads; logits are compared
with PyTorch's. Training a head adapter is compared with the same training written by hand in
plain JAX and optax. ``transformers`` is slow to import, so the tests share module fixtures.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tied

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gpt2_lora.py"
IDS = np.array([[1, 5, 9, 2, 7, 63, 0, 11], [4, 4, 8, 30, 2, 1, 60, 3]])
RANK, ALPHA = 4, 8
# peft 0.21 reads transformers 5.25's deprecated alias when it wraps a model (not our code).
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("gpt2_lora", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A random GPT2LMHeadModel (head tied to the embedding) saved by ``save_pretrained``."""
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # larger than GPT-2's 0.02 init, so that a wrong map shows in the logits
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    d = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(d)
    return str(d)


def hf(directory):
    return transformers.GPT2LMHeadModel.from_pretrained(directory).eval()


def logits_of(torch_model) -> np.ndarray:
    with torch.no_grad():
        return torch_model(torch.tensor(IDS)).logits.float().numpy()


def trained_adapters(model, seed: int = 1):
    """Adapters on c_attn of every block, lora_B away from zero (as after training)."""
    adapted = tied.nn.lora(
        model, lambda p, layer: p.endswith(".attn.qkv"), RANK, alpha=ALPHA, key=jax.random.key(seed)
    )
    for i, block in enumerate(adapted.blocks):
        qkv = block.attn.qkv
        qkv.lora_B = 0.2 * jax.random.normal(jax.random.key(100 + i), qkv.lora_B.shape)
    return adapted


def test_peft_reads_tieds_adapter_files_with_tieds_logits(example, base_dir, tmp_path):
    model = example.load_gpt2(base_dir)
    adapted = trained_adapters(model)
    example.save_peft(adapted, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]
    theirs = peft.PeftModel.from_pretrained(hf(base_dir), str(tmp_path)).eval()
    ours = np.asarray(adapted(jnp.asarray(IDS)))
    assert np.abs(ours - np.asarray(model(jnp.asarray(IDS)))).max() > 1e-2  # the adapters count
    np.testing.assert_allclose(logits_of(theirs), ours, atol=1e-4)
    # and peft's merge of that file is tied's merge
    merged = tied.nn.merge(adapted)
    np.testing.assert_allclose(
        logits_of(theirs.merge_and_unload()), np.asarray(merged(jnp.asarray(IDS))), atol=1e-4
    )


def test_tied_reads_an_adapter_peft_saved_from_pytorch(example, base_dir, tmp_path):
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0
    )
    theirs = peft.get_peft_model(hf(base_dir), config).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    theirs.save_pretrained(str(tmp_path))
    plain = example.load_gpt2(base_dir)
    for start in (plain, trained_adapters(plain, seed=5)):  # with or without adapters of its own
        ours = example.load_peft(start, str(tmp_path))
        np.testing.assert_allclose(np.asarray(ours(jnp.asarray(IDS))), logits_of(theirs), atol=1e-4)
        assert ours.head.weight is ours.wte.weight
    merged = tied.nn.merge(ours)
    np.testing.assert_allclose(
        np.asarray(merged(jnp.asarray(IDS))), logits_of(theirs.merge_and_unload()), atol=1e-4
    )


def test_a_merged_head_is_saved_untied_and_from_pretrained_gives_the_merged_logits(
    example, base_dir, tmp_path
):
    model = example.load_gpt2(base_dir)
    adapted = tied.nn.lora(trained_adapters(model), ".head", RANK, alpha=ALPHA, key=jax.random.key(7))
    adapted.head.lora_B = 0.2 * jax.random.normal(jax.random.key(8), adapted.head.lora_B.shape)
    merged = tied.nn.merge(adapted)
    assert merged.wte.weight is model.wte.weight  # the embedding place, bit for bit
    assert merged.head.weight is not merged.wte.weight
    assert tied.ties(merged) == []
    want = np.asarray(adapted(jnp.asarray(IDS)))
    np.testing.assert_allclose(np.asarray(merged(jnp.asarray(IDS))), want, atol=1e-5)
    example.save_gpt2(merged, str(tmp_path))
    with open(tmp_path / "config.json", encoding="utf-8") as f:
        assert json.load(f)["tie_word_embeddings"] is False
    back = hf(str(tmp_path))
    assert back.lm_head.weight.data_ptr() != back.transformer.wte.weight.data_ptr()
    np.testing.assert_allclose(logits_of(back), want, atol=1e-4)
    np.testing.assert_array_equal(back.transformer.wte.weight.detach().numpy(), np.asarray(model.wte.weight))


def test_a_head_adapter_trained_five_adam_steps_leaves_wte_and_equals_plain_jax(example, base_dir):
    model = example.load_gpt2(base_dir)
    wte = np.asarray(model.wte.weight).copy()
    adapted = tied.nn.lora(model, ".head", RANK, alpha=ALPHA, key=jax.random.key(3))
    assert adapted.head.base.weight is adapted.wte.weight  # the head's base is the embedding
    ids, targets = jnp.asarray(IDS[:, :-1]), jnp.asarray(IDS[:, 1:])

    def loss_fn(m, ids, targets):
        logits = m(ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    tx = optax.adam(1e-2)
    state = tied.optim.setup(tx, adapted, trainable=tied.nn.adapters)
    assert state.paths == (".head.lora_A", ".head.lora_B")

    @tied.jit
    def step(m, state, ids, targets):
        loss, g = tied.value_and_grad(loss_fn, trainable=tied.nn.adapters)(m, ids, targets)
        m, state = tied.optim.update(state, m, g)
        return m, state, loss

    m = adapted
    for _ in range(5):
        m, state, _ = step(m, state, ids, targets)
    assert m.wte.weight is m.head.base.weight
    np.testing.assert_array_equal(np.asarray(m.wte.weight), wte)  # bit for bit
    assert np.abs(np.asarray(m.head.lora_B)).max() > 0  # the adapter moved

    # The same training by hand: the trunk is frozen, so the hidden states are constants.
    x = model.wte(ids) + model.wpe(jnp.arange(ids.shape[-1]))
    for block in model.blocks:
        x = block(x)
    h = model.ln_f(x)
    w = jnp.asarray(wte)

    def hand_loss(p):
        logits = h @ w.T + (ALPHA / RANK) * (h @ p["A"].T) @ p["B"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    p = {"A": adapted.head.lora_A, "B": adapted.head.lora_B}
    opt = tx.init(p)
    for _ in range(5):
        g = jax.grad(hand_loss)(p)
        u, opt = tx.update(g, opt, p)
        p = optax.apply_updates(p, u)
    np.testing.assert_allclose(np.asarray(m.head.lora_A), np.asarray(p["A"]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(m.head.lora_B), np.asarray(p["B"]), atol=1e-5)


def test_save_peft_refuses_a_head_adapter_and_load_peft_a_dora_config(example, base_dir, tmp_path):
    model = example.load_gpt2(base_dir)
    adapted = tied.nn.lora(model, ".head", RANK, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"adapter at \.head .*tied\.save"):
        example.save_peft(adapted, str(tmp_path))
    example.save_peft(trained_adapters(model), str(tmp_path))
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match=r"use_dora=True"):
        example.load_peft(model, str(tmp_path))
