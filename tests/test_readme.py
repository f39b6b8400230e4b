"""The README's Python examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_seed_example_runs_and_its_claims_hold():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # the asserts inside must hold
    c, g = namespace["c"], namespace["g"]
    assert g.layers[0].weight is g.layers[1].weight
    import tied

    assert tied.ties(c) == [
        (".layers[0].weight", ".layers[1].weight"),
        (".layers[0].bias", ".layers[1].bias"),
    ]


def test_readme_training_example_continues_the_seed_and_holds(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    training = next(b for b in blocks if "tied.optim.setup" in b)
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    before = namespace["c"].layers[0].weight
    exec(compile(training.replace("/tmp/seed.safetensors", str(tmp_path / "seed.safetensors")),
                 "README.md", "exec"), namespace)
    c = namespace["c"]
    assert c.layers[0].weight is c.layers[1].weight
    assert not (c.layers[0].weight == before).all()  # three Adam steps moved it
