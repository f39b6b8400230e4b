"""LoRA on GPT-2 with its head tied to the embedding, in peft's own adapter files, and merged.

The model is `examples/gpt2_from_transformers.py`'s `GPT2` (the head ``Dense(wte.weight)``).

* `tied.nn.lora(model, where, rank, key=...)` puts adapters on ``c_attn`` (``attn.qkv``) of
  every block; `tied.nn.adapters` trains them alone.
* `save_peft` writes the adapters as peft writes them (``adapter_model.safetensors`` with
  peft's keys, ``base_model.model.transformer.h.{i}.attn.c_attn.lora_A.weight``, and
  ``adapter_config.json``), so ``peft.PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(
  base_dir), adapter_dir)`` gives tied's logits; `load_peft` reads such a directory (written by
  peft from PyTorch, or by `save_peft`) into a tied GPT-2. GPT-2's ``Conv1D`` stores its weight
  ``(in, out)`` (peft's ``fan_in_fan_out``), but peft's ``lora_A`` is ``(r, in)`` and ``lora_B``
  ``(out, r)`` either way: the same arrays as `tied.nn.LoRA`'s, nothing to transpose.
* `tied.nn.merge` folds the adapters into the weights; an adapter on the tied head merges into
  a head of its own, the embedding unchanged, and `save_gpt2` writes that head as
  ``lm_head.weight`` with ``tie_word_embeddings: false``.

An adapter on the head (``.head``) is kept in tied's own format (`tied.save` of the model):
peft's file for a head tied to the embedding is what peft #2018 merges into the embedding too.
This file imports neither ``transformers`` nor ``peft`` (``tests/test_gpt2_lora.py`` checks it
against both). Random configurations only: nothing is downloaded.

Run: python examples/gpt2_lora.py  (a random GPT-2 adapted, saved as peft does, read back, merged)
"""

from __future__ import annotations

import importlib.util
import json
import operator
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

import tied


def _sibling(name: str):
    """The example beside this one, as a module (run as a script or loaded by a test)."""
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpt2 = _sibling("gpt2_from_transformers")
GPT2, save_gpt2, load_gpt2 = gpt2.GPT2, gpt2.save_gpt2, gpt2.load_gpt2

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def peft_modules(n_layer: int) -> dict[str, str]:
    """Each layer place of `GPT2` that peft can adapt -> its module name in ``GPT2LMHeadModel``."""
    return {
        f".blocks[{i}].{ours}": f"transformer.h.{i}.{theirs}"
        for i in range(n_layer)
        for ours, theirs in gpt2._BLOCK.items()
        if ours in gpt2._CONV1D
    }


def _layers(model) -> dict:
    """The layer at each place where an adapter may stand: the blocks' Conv1D layers and the head."""
    out = {".head": model.head}
    for i, block in enumerate(model.blocks):
        for name in gpt2._CONV1D:
            out[f".blocks[{i}].{name}"] = operator.attrgetter(name)(block)
    return out


def _adapters(model) -> dict[str, tied.nn.LoRA]:
    """Every `tied.nn.LoRA` of ``model`` by its place; one elsewhere (on the embedding's lookup,
    say) is an error."""
    layers = _layers(model)
    _, gdef = tied.flatten(model)
    found = {}
    for p in gdef.walk_places():
        if isinstance(p.type, type) and issubclass(p.type, tied.nn.LoRA):
            if p.path not in layers:
                raise ValueError(f"{p.path} holds a tied.nn.LoRA, which this GPT-2's files cannot hold.")
            found[p.path] = layers[p.path]
    return found


def save_peft(model, directory: str) -> None:
    """Write ``model``'s adapters as ``adapter_model.safetensors`` + ``adapter_config.json``, as peft does.

    Args:
        model: a `GPT2` with `tied.nn.LoRA` adapters on Conv1D places of its blocks
            (``attn.qkv`` = ``c_attn``, ``attn.proj``, ``mlp.fc1``, ``mlp.fc2``), of one rank and alpha.
        directory: where to write (made if missing).

    Raises:
        ValueError: no adapter; an adapter on a place peft's GPT-2 file cannot hold (the tied
            head: keep it in tied's format with `tied.save`); adapters of different ranks or alphas.
    """
    modules = peft_modules(model.config["n_layer"])
    found = _adapters(model)
    if not found:
        raise ValueError("save_peft: the model has no tied.nn.LoRA adapter; add some with tied.nn.lora.")
    tensors, targets, ranks = {}, set(), set()
    for place, adapter in found.items():
        if place not in modules:
            raise ValueError(
                f"save_peft: the adapter at {place} has no place in peft's GPT-2 layout (only the "
                "blocks' Conv1D layers do). An adapter on the tied head stays in tied's own format: "
                "tied.save(path, model)."
            )
        name = modules[place]
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = np.asarray(adapter.lora_A, np.float32)
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = np.asarray(adapter.lora_B, np.float32)
        targets.add(name.rsplit(".", 1)[-1])
        ranks.add((adapter.rank, adapter.alpha))
    if len(ranks) != 1:
        raise ValueError(
            f"save_peft: one rank and alpha for every adapter, as peft's config holds; got {ranks}."
        )
    ((rank, alpha),) = ranks
    os.makedirs(directory, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "inference_mode": True,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "fan_in_fan_out": True,  # GPT-2's Conv1D holds (in, out)
        "bias": "none",
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
    }
    with open(os.path.join(directory, CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(directory, WEIGHTS), metadata={"format": "pt"})


def _bare(model):
    """``model`` with every adapter replaced by its base (not merged)."""
    for place, adapter in _adapters(model).items():
        model = tied.replace(model, place, adapter.base)
    return model


def load_peft(model, directory: str):
    """A new `GPT2` holding the LoRA adapters of a peft directory (``model``'s own adapters dropped).

    Args:
        model: a `GPT2`, with or without adapters (not changed).
        directory: a peft LoRA adapter directory (``adapter_config.json``, ``adapter_model.safetensors``).

    Returns:
        The model with a `tied.nn.LoRA` at each adapted place, holding the file's arrays.

    Raises:
        ValueError: a config this GPT-2 cannot read (not LoRA, rslora, DoRA, per-layer ranks,
            trained biases, saved modules), a key that names no adaptable place, or an array of
            another shape than the place's adapter (naming the key and the place).
    """
    with open(os.path.join(directory, CONFIG), encoding="utf-8") as f:
        config = json.load(f)
    refused = {
        "peft_type": config.get("peft_type") != "LORA",
        "use_rslora": bool(config.get("use_rslora")),
        "use_dora": bool(config.get("use_dora")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
    }
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise ValueError(
            f"load_peft: {directory}'s adapter_config.json sets "
            f"{', '.join(f'{k}={config.get(k)!r}' for k in bad)}; "
            "only plain LoRA adapters (one r and lora_alpha, no bias, no saved modules) are read here."
        )
    rank, alpha = int(config["r"]), config["lora_alpha"]
    tensors = load_file(os.path.join(directory, WEIGHTS))
    places = {name: place for place, name in peft_modules(model.config["n_layer"]).items()}
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        name, which = key.removeprefix(_PREFIX).rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        if not key.startswith(_PREFIX) or name not in places or which not in ("lora_A", "lora_B"):
            raise ValueError(f"load_peft: {key!r} in {WEIGHTS} names no adaptable place of this GPT-2.")
        arrays.setdefault(places[name], {})[which] = value
    model = tied.nn.lora(_bare(model), sorted(arrays), rank, alpha=alpha, key=jax.random.key(0))
    for place, pair in arrays.items():
        adapter = _layers(model)[place]
        for which in ("lora_A", "lora_B"):
            want = getattr(adapter, which)
            got = pair.get(which)
            if got is None or got.shape != want.shape:
                raise ValueError(
                    f"load_peft: {which} of {place} should have shape {want.shape} (r={rank}), the file "
                    f"holds {None if got is None else got.shape}."
                )
            model = tied.replace(model, f"{place}.{which}", jnp.asarray(got, want.dtype))
    return model


def main() -> dict:
    config = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16}
    model = GPT2(config, key=jax.random.key(0))
    adapted = tied.nn.lora(
        model, lambda path, layer: path.endswith(".attn.qkv"), 4, alpha=8, key=jax.random.key(1)
    )
    # A trained adapter: lora_B away from its zeros (a fine-tuning run would do this).
    for i, block in enumerate(adapted.blocks):
        block.attn.qkv.lora_B = 0.1 * jax.random.normal(jax.random.key(10 + i), block.attn.qkv.lora_B.shape)
    ids = jnp.array([[1, 5, 9, 2, 7]])
    with tempfile.TemporaryDirectory() as d:
        save_peft(adapted, d)
        files = sorted(os.listdir(d))
        back = load_peft(model, d)
    same = bool(np.allclose(back(ids), adapted(ids), atol=1e-6))
    merged = tied.nn.merge(tied.nn.lora(adapted, ".head", 4, key=jax.random.key(2)))
    kept = merged.wte.weight is model.wte.weight
    print(
        f"wrote {files}; read back: same logits {same}; merged head is the embedding: "
        f"{merged.head.weight is merged.wte.weight}; embedding unchanged: {kept}"
    )
    return {"files": files, "same": same, "embedding_kept": kept}


if __name__ == "__main__":
    main()
