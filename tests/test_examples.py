"""Every example in examples/ runs and shows what it claims (loss down, ties held)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_tested():
    tested = {"seed", "albert", "tied_autoencoder", "tied_lm", "siamese", "rnn", "equinox_interop"}
    tested.add("data_parallel")  # run under 8 fake devices by tests/test_sharding.py (tests/multidevice)
    tested.add("optax_by_path")  # run by tests/test_optim.py
    tested.add("flax_nnx_interop")
    tested.add("multihost")  # run as 2 local processes by tests/test_multiprocess.py
    tested.add("cnn_batchnorm")
    tested.add("resumable_training")  # run (and killed, and resumed) by tests/test_manager.py
    tested.add("gpt2_from_transformers")  # run against transformers itself by tests/test_hf.py
    tested.add("scan_lm")
    tested.add("pipeline_lm")  # run under 8 fake devices by tests/transforms/test_sharding_pipeline.py
    tested.add("gpt2_lora")  # and against peft and transformers themselves by tests/test_gpt2_lora.py
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


def test_seed_runs_as_a_script_and_prints_both_gradients():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "seed.py")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "g.layers[0].weight is g.layers[1].weight: True" in out.stdout
    assert "gs[d1.weight] == g.layers[0].weight: True | x is a key: False" in out.stdout
    assert "p.layers[0].weight is p.layers[1].weight: False" in out.stdout


def test_seed_totals_against_plain_jax():
    r = load("seed").main(verbose=False)
    assert r["aliased"] and r["implicit_equals_explicit"] and r["partials_sum_to_total"]
    assert not r["x_in_implicit"]
    d1, x = r["model"].layers[0], r["x"]

    def untied(w1, b1, w2, b2):
        return ((x @ w1.T + b1) @ w2.T + b2).sum()

    parts = jax.grad(untied, argnums=(0, 2))(d1.weight, d1.bias, d1.weight, d1.bias)
    np.testing.assert_allclose(r["total"], parts[0] + parts[1], rtol=1e-5)


def test_albert():
    r = load("albert").main(verbose=False)
    assert r["shared"]
    block_params = (r["per_place"] - r["unique"]) // 5  # six places, five of them repeats
    assert r["per_place"] - r["unique"] == 5 * block_params > 0
    assert r["loss_after"] < 0.5 * r["loss_before"]


def test_tied_autoencoder_reaches_pca():
    r = load("tied_autoencoder").main(verbose=False)
    assert r["grad_aliased"] and r["follows"]
    assert r["loss_after"] < r["loss_before"] / 10
    assert r["loss_after"] < 1.2 * r["pca"]


def test_tied_lm():
    r = load("tied_lm").main(verbose=False)
    assert r["one_gradient"] and r["still_tied"]
    assert r["loss_after"] < r["loss_before"] - 1.0
    assert r["text"].startswith("Shall I ") and len(r["text"]) == 32 and r["generate_compiles"] == 1


def test_siamese():
    r = load("siamese").main(verbose=False)
    assert r["one_node"] and r["shared"]
    assert r["loss_after"] < r["loss_before"] / 2
    assert r["acc_after"] >= 0.9


def test_rnn_loop_and_scan_agree():
    r = load("rnn").main(verbose=False)
    assert r["same_output"] and r["one_node"] and r["same_grad"] and r["agree"]
    assert r["loss_after"] < r["loss_before"] / 5


def test_equinox_interop_tied_keeps_the_tie_plain_equinox_breaks_it():
    r = load("equinox_interop").main(verbose=False)
    assert r["one_node"] and r["kept"] and r["reloaded"]
    assert r["total_gap"] < 1e-5
    assert r["plain_broken"]
    assert (r["tied_states"], r["plain_states"]) == (6, 8)
    assert r["loss_after"] < r["loss_before"] / 10
    assert jnp.isfinite(r["loss_after"])


def test_flax_nnx_interop_tied_agrees_with_nnx_plain_jax_breaks_the_tie():
    r = load("flax_nnx_interop").main(verbose=False)
    assert r["one_grad"] and r["kept"] and r["reloaded"]
    assert r["total_gap"] < 1e-5 and r["agree_with_nnx"] < 1e-4
    assert r["plain_broken"]
    assert r["loss_after"] < r["loss_before"] / 10


def test_cnn_batchnorm_shared_block_statistics_and_modes():
    r = load("cnn_batchnorm").main(verbose=False)
    assert r["shared"] and r["eval_shares_state"] and r["eval_counted_nothing"]
    assert r["updates"] == 2 * 150  # the shared BatchNorm moves twice per step
    assert r["dropout_draws"] == 150
    assert r["acc_eval"] >= 0.85 and r["acc_eval_train_set"] >= 0.85


def test_scan_lm():
    r = load("scan_lm").main(verbose=False)
    assert r["one_gradient"] and r["still_tied"]
    assert r["loss_after"] < r["loss_before"] - 1.0
    assert r["train_traces"] == 1 and r["generate_compiles"] == 1  # one block traced, not twelve
    assert r["decode_matches_forward"]
    assert r["text"].startswith("Shall I ") and len(r["text"]) == 32
    np.testing.assert_array_equal(r["positions"], [31] * 12)  # every block's cache written


def test_gpt2_lora_reads_back_its_peft_files_and_merges_the_head_alone():
    out = load("gpt2_lora").main()
    assert out["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert out["same"] and out["embedding_kept"]
