"""mkdocs hook: the pictures of DAGs, drawn by `tied.to_dot` and rendered by Graphviz at build time.

``seed_dag.svg`` (the home page: the seed example, a Chain whose second Dense holds the first one's
arrays) and ``demo_dag.svg`` (the demo page: the demo's transformer, its arrays labelled with
dtype and shape only so that it fits the page) are made from the models
themselves on every build, so the pictures cannot drift from what `tied` draws. They are added to
the site as generated files (nothing is written into docs/). Without Graphviz's ``dot`` each is a
placeholder saying so (``make docs`` installs Graphviz where it can).
"""

from __future__ import annotations

import html
import logging
import re
import shutil
import subprocess

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.dags")

# Tighter than Graphviz's defaults so the demo's 40 boxes fit a page's width at a readable size.
_SPACING = ["-Granksep=0.22", "-Gnodesep=0.06"]


def _seed():
    import jax

    from tied.nn import Chain, Dense

    d1 = Dense(2, 2, key=jax.random.key(0))
    return Chain(d1, Dense(d1.weight, d1.bias))  # the second layer shares both arrays


def _demo():
    import jax

    from tied.demo import CharTransformer, load_corpus

    return CharTransformer(len(set(load_corpus())), key=jax.random.key(0))


def _svg(model, name: str, short: bool = False) -> str:
    import tied

    dot = tied.to_dot(model)
    if short:  # an array's label without its path (the edges into it name the fields): narrower
        dot = re.sub(r'label="([^"\\]*)\\n[^"]*", shape=ellipse', r'label="\1", shape=ellipse', dot)
    exe = shutil.which("dot")
    if exe is None:
        log.info("dags: Graphviz's dot is not installed; %s is a placeholder", name)
        text = html.escape("Graphviz's dot was not installed when the site was built (make docs installs it)")
        return (
            '<svg xmlns="http://www.w3.org/2000/svg" width="640" height="40">'
            f'<text x="8" y="24" font-family="sans-serif" font-size="13">{text}</text></svg>'
        )
    out = subprocess.run([exe, "-Tsvg", *_SPACING], input=dot, capture_output=True, text=True, check=True)
    return out.stdout


def on_files(files, config):
    for name, make, short in (("seed_dag.svg", _seed, False), ("demo_dag.svg", _demo, True)):
        files.append(File.generated(config, name, content=_svg(make(), name, short)))
    return files
