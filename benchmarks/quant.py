"""`tied.nn.quantize`: the parameter bytes of an int8 (and int4) tied GPT-2, side by side.

The model of ``examples/gpt2_from_transformers.py`` (its head ``Dense(wte.weight)``, tied
as `tied.load` of a Hugging Face file gives it), random weights, GPT-2's vocabulary
(50,257 tokens) and a narrow body, so the tied table is most of the model, as in the
small models that tie. Every Dense and Embedding is quantized. The bytes are counted over
the model's unique arrays (`tied.flatten`: a tied array once), as held in memory and as
`tied.save` stores them:

* **float**: the float32 model;
* **tied int8 / int4**: `tied.nn.quantize(model, all layers)`: the table one integer array
  and one scale array, read at both places;
* **untie, then quantize**: what a quantizer that cannot keep a tie does (transformers
  #37905, ROCm/vllm #1213): the head given its own copy first (`tied.untie`), so two
  integer tables.

Also: XLA's temporary bytes of one compiled forward pass (its memory analysis), float
against tied int8, beside the size of the float table that the int8 model never makes.

    python -m benchmarks.quant [--layers 2] [--dim 128]
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp

import tied

from .timing import arguments

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt2_from_transformers.py"
VOCAB = 50257


def _example():
    spec = importlib.util.spec_from_file_location("gpt2_from_transformers", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nbytes(model) -> int:
    """Bytes of the model's unique arrays (a tied array counted once)."""
    return sum(x.nbytes for x in tied.flatten(model)[0])


def _temp_bytes(model, ids) -> int | None:
    """XLA's temporary bytes for one forward pass (None where the backend does not say)."""
    leaves, gdef = tied.flatten(model)
    compiled = jax.jit(lambda xs: tied.unflatten(gdef, xs)(ids)).lower(leaves).compile()
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def run(layers: int = 2, dim: int = 128) -> dict:
    gpt2 = _example()
    config = {"n_layer": layers, "n_embd": dim, "n_head": 4, "vocab_size": VOCAB, "n_positions": 64}
    model = gpt2.GPT2(config, key=jax.random.key(0))
    every = lambda path, layer: True  # noqa: E731 - every Dense and Embedding
    untied = tied.untie(model, ".head.weight")
    out = {"config": config, "bytes": {}}
    out["bytes"]["float"] = nbytes(model)
    out["bytes"]["tied int8"] = nbytes(tied.nn.quantize(model, every))
    out["bytes"]["tied int4"] = nbytes(tied.nn.quantize(model, every, bits=4))
    out["bytes"]["untie, then int8"] = nbytes(tied.nn.quantize(untied, every))
    out["bytes"]["untie, then int4"] = nbytes(tied.nn.quantize(untied, every, bits=4))
    b = out["bytes"]
    out["ratio"] = {
        "tied int8 / float": b["tied int8"] / b["float"],
        "tied int8 / untie, then int8": b["tied int8"] / b["untie, then int8"],
        "tied int4 / untie, then int4": b["tied int4"] / b["untie, then int4"],
    }
    ids = jnp.arange(16)[None] * 997 % VOCAB
    out["forward_temp_bytes"] = {
        "float": _temp_bytes(model, ids),
        "tied int8": _temp_bytes(tied.nn.quantize(model, every), ids),
    }
    out["table_float_bytes"] = VOCAB * dim * 4
    return out


def report(r: dict) -> list[str]:
    """Lines of markdown for `benchmarks/results.md`."""
    c = r["config"]
    lines = [
        "## Quantized tied GPT-2: parameter bytes",
        "",
        f"The GPT-2 of `examples/gpt2_from_transformers.py` ({c['n_layer']} blocks, width {c['n_embd']}, "
        f"vocabulary {c['vocab_size']:,}), head tied to the token embedding, every Dense and Embedding "
        "quantized; bytes of the unique arrays (what memory holds and `tied.save` stores).",
        "",
        "| model | bytes | against float | against untie, then quantize |",
        "|---|---|---|---|",
    ]
    b = r["bytes"]
    for name in ("float", "tied int8", "untie, then int8", "tied int4", "untie, then int4"):
        pair = {"tied int8": "untie, then int8", "tied int4": "untie, then int4"}.get(name)
        versus = f"{b[name] / b[pair]:.2f}x" if pair else ""
        lines.append(f"| {name} | {b[name] / 2**20:.2f} MiB | {b[name] / b['float']:.2f}x | {versus} |")
    t = r["forward_temp_bytes"]
    if t["float"] is not None and t["tied int8"] is not None:
        lines += [
            "",
            f"XLA's temporaries of one forward pass (16 tokens): float {t['float'] / 2**20:.2f} MiB, "
            f"tied int8 {t['tied int8'] / 2**20:.2f} MiB, against {r['table_float_bytes'] / 2**20:.2f} MiB "
            "for the float table alone: the lookup gathers rows, and the head, whose integer operand XLA "
            "on CPU converts to float, multiplies 4,096 rows at a time (pieces of logits and one float "
            "block are the temporaries).",
        ]
    lines.append("")
    return lines


def main(argv=None) -> dict:
    parser = arguments(__doc__, rounds=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args(argv)
    r = run(args.layers, args.dim)
    print("\n".join(report(r)), flush=True)
    return r


if __name__ == "__main__":
    main()
