"""GPT-2 from and back to a Hugging Face ``save_pretrained`` directory, the head tied to the embedding.

GPT-2's checkpoints store the token embedding once (``transformer.wte.weight``) and
omit ``lm_head.weight``: the head *is* the embedding (``tie_word_embeddings``). Here
GPT-2 is written with `tied.nn` layers, the head ``Dense(self.wte.weight)``, so the
tie is the object graph's own, and

* `load_gpt2` reads a ``save_pretrained`` directory (one file or a sharded set) with
  ``tied.load(strict=False)``: ``rename`` maps Hugging Face's keys to places, and
  ``transform`` transposes the four ``Conv1D`` weights of each block, which GPT-2 stores
  ``(in, out)`` where `tied.nn.Dense` holds ``(out, in)``; the file's one embedding fills
  both the embedding and the head, which come back as one array (``is``);
* `save_gpt2` writes one back with ``tied.save(keys=..., transform=..., max_shard_size=...)``:
  the embedding stored once under ``transformer.wte.weight``, no ``lm_head.weight``, the
  ``Conv1D`` weights transposed back, and a ``config.json``, so that
  ``transformers.GPT2LMHeadModel.from_pretrained(directory)`` reads it.

This file does not import ``transformers`` (``tests/checkpoint/test_hf.py`` checks it against
``transformers`` itself); it only needs ``config.json``'s fields. Random configurations
only: nothing is downloaded.

Run: python examples/gpt2_from_transformers.py  (a random GPT-2 saved, loaded, compared)
"""

from __future__ import annotations

import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import tied
from tied.nn import Dense, Embedding, LayerNorm, TransformerBlock

# tied.nn's names within a block -> GPT-2's, and which of them are Conv1D weights (stored (in, out)).
_BLOCK = {
    "ln1": "ln_1",
    "ln2": "ln_2",
    "attn.qkv": "attn.c_attn",
    "attn.proj": "attn.c_proj",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}
_CONV1D = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


@tied.register
class GPT2:
    """GPT-2 (pre-LN blocks, learned positions, tanh GELU), its head tied to the token embedding."""

    def __init__(self, config: dict, *, key):
        dim, layers, eps = config["n_embd"], config["n_layer"], config.get("layer_norm_epsilon", 1e-5)
        keys = jax.random.split(key, layers + 2)
        self.config = {k: config[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")}
        self.config["layer_norm_epsilon"] = float(eps)
        self.wte = Embedding(config["vocab_size"], dim, key=keys[0])
        self.wpe = Embedding(config["n_positions"], dim, key=keys[1])
        self.blocks = [TransformerBlock(dim, config["n_head"], key=k) for k in keys[2:]]
        for b in self.blocks:
            b.ln1.eps = b.ln2.eps = float(eps)
        self.ln_f = LayerNorm(dim, eps=eps)
        self.head = Dense(self.wte.weight)  # the tie: one array at two places

    def __call__(self, ids):
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[-1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def hf_keys(n_layer: int) -> dict[str, str]:
    """Each place of `GPT2` -> its key in a Hugging Face ``GPT2LMHeadModel`` state dict."""
    keys = {".head.weight": "lm_head.weight"}
    for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
        keys[f".{name}"] = f"transformer.{name}"
    for i in range(n_layer):
        for ours, theirs in _BLOCK.items():
            for leaf in ("weight", "bias"):
                keys[f".blocks[{i}].{ours}.{leaf}"] = f"transformer.h.{i}.{theirs}.{leaf}"
    return keys


def conv1d_places(n_layer: int) -> list[str]:
    """The places whose Hugging Face weight is a ``Conv1D``'s, stored transposed."""
    return [f".blocks[{i}].{name}.weight" for i in range(n_layer) for name in _CONV1D]


def _transpose(a):
    return a.T


def load_gpt2(directory: str, *, dtype: str | None = None) -> GPT2:
    """A `GPT2` read from a ``save_pretrained`` directory (``config.json`` and the weights).

    ``dtype="like"`` reads a float16 or bfloat16 checkpoint into the float32 model.
    """
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    # Shapes only: no random initialisation of weights that the file replaces.
    like = jax.eval_shape(lambda: tied.Graph(GPT2(config, key=jax.random.key(0)))).value
    places = hf_keys(config["n_layer"])
    return tied.load(
        directory,
        like,
        strict=False,
        rename={key: place for place, key in places.items()},
        transform={place: _transpose for place in conv1d_places(config["n_layer"])},
        dtype=dtype,
    )


def save_gpt2(model: GPT2, directory: str, *, max_shard_size: int | str = "5GB") -> None:
    """Write ``model`` as a directory that ``GPT2LMHeadModel.from_pretrained`` reads (sharded set).

    A head tied to the embedding is stored once (``transformer.wte.weight``); a head with its own
    array (a merged LoRA, `tied.nn.merge`) is written as ``lm_head.weight`` with
    ``tie_word_embeddings: false``.
    """
    c = model.config
    os.makedirs(directory, exist_ok=True)
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **c,
        "n_ctx": c["n_positions"],
        "activation_function": "gelu_new",
        # a head merged from an adapter has its own array: written as lm_head.weight, untied
        "tie_word_embeddings": model.head.weight is model.wte.weight,
    }
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    n = c["n_layer"]
    tied.save(
        directory,
        model,
        keys=hf_keys(n),
        transform={place: _transpose for place in conv1d_places(n)},
        max_shard_size=max_shard_size,
    )


def main() -> dict:
    config = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16}
    model = GPT2(config, key=jax.random.key(0))
    ids = jnp.array([[1, 5, 9, 2, 7]])
    with tempfile.TemporaryDirectory() as d:
        save_gpt2(model, d, max_shard_size="10KB")
        files = sorted(os.listdir(d))
        back = load_gpt2(d)
    same = bool(np.allclose(back(ids), model(ids), atol=1e-6))
    print(f"saved {files}; head is embedding: {back.head.weight is back.wte.weight}; same logits: {same}")
    return {"files": files, "tied": back.head.weight is back.wte.weight, "same": same}


if __name__ == "__main__":
    main()
