"""Every Python block of the README runs alone, in a fresh interpreter, with only its stated extras.

A reader pastes one block into a new session after `pip install tied` (plus the extras the
block's first line names, `# needs: flax`). So each block runs in its own subprocess, where
importing a module of an extra the block does not name fails as it would on a plain install.
Blocks that use several devices (a `Mesh`, `tied.data_parallel`) get 8 fake CPU devices.
The README's reference moved to the docs pages, whose blocks `tests/test_doctests.py` runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# The modules each extra brings (pyproject.toml's optional dependencies); the base install has none.
EXTRAS = {
    "flax": {"flax"},
    "equinox": {"equinox"},
    "demo": {"tqdm", "matplotlib"},
    "docs": {"mkdocs", "material", "mkdocstrings"},
    "bench": {"flax", "equinox", "torch"},
    "test": {"pytest", "hypothesis", "flax", "equinox", "tqdm", "torch"},
}
OPTIONAL = set().union(*EXTRAS.values())


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def needs(block: str) -> set[str]:
    first = block.lstrip().splitlines()[0]
    m = re.match(r"#\s*needs:\s*(.+)$", first)
    return {e.strip() for e in m.group(1).split(",")} if m else set()


def multi_device(block: str) -> bool:
    return "data_parallel(" in block or "Mesh(" in block


# Run before the block: the modules of extras it does not name cannot be imported.
PRELUDE = """
import importlib.abc, sys

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {name!r} (this README block names no extra that brings it: "
                "start it with '# needs: <extra>')", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""

# Checks after a block, by its index: what its comments claim, beyond its own asserts.
AFTER = {
    0: """
assert tied.ties(c) == [(".layers[0].weight", ".layers[1].weight"), (".layers[0].bias", ".layers[1].bias")]
assert g.layers[0].bias is g.layers[1].bias and len(state.paths) == 2
""",
}


def run_block(k: int, block: str, tmp_path: Path) -> subprocess.CompletedProcess:
    allowed = set().union(*(EXTRAS[e] for e in needs(block))) if needs(block) else set()
    code = block.replace("/tmp/", f"{tmp_path}/")
    script = tmp_path / f"readme_block_{k}.py"
    script.write_text(
        f"BLOCKED = {sorted(OPTIONAL - allowed)!r}\n"
        + PRELUDE
        + f"exec(compile({code!r}, 'README.md block {k}', 'exec'))\n"
        + textwrap.dedent(AFTER.get(k, ""))
        + f"print('README block {k} ok')\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if multi_device(block):
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )


BLOCKS = python_blocks()


def test_the_readme_has_the_blocks_this_test_expects():
    assert len(BLOCKS) >= 3
    assert sum(map(multi_device, BLOCKS)) >= 1
    assert any("flax" in needs(b) for b in BLOCKS)
    for b in BLOCKS:
        assert needs(b) <= set(EXTRAS), f"unknown extra in {b.splitlines()[0]!r}"


@pytest.mark.parametrize("k", range(len(BLOCKS)))
def test_every_block_runs_alone_with_only_its_extras(k, tmp_path):
    out = run_block(k, BLOCKS[k], tmp_path)
    assert out.returncode == 0, f"README block {k}:\n{BLOCKS[k]}\n{out.stderr[-4000:]}"
    assert f"README block {k} ok" in out.stdout


def test_a_block_without_its_marker_fails_as_on_a_plain_install(tmp_path):
    # the check above is not vacuous: an NNX block with its marker removed cannot import flax
    block = next(b for b in BLOCKS if "flax" in needs(b))
    out = run_block(99, block.split("\n", 1)[1], tmp_path)
    assert out.returncode != 0 and "No module named 'flax'" in out.stderr


def test_the_readme_is_short_and_has_the_sections_a_new_user_needs():
    text = README.read_text()
    heads = re.findall(r"^## (.+)$", text, flags=re.M)
    for h in ("Install", "Supported versions", "A short tour", "State", "Documentation"):
        assert h in heads, heads
    assert len(text.splitlines()) <= 200
    first = text.index("```python")
    assert text.count("\n", 0, first) < 30  # the example starts on the first screen
    state = text.split("## State\n", 1)[1].split("\n## ", 1)[0]
    # a few lines of prose and one block that runs alone (every block runs above): state written back
    prose, block = state.split("```python\n", 1)
    assert 3 <= len([s for s in prose.strip().splitlines() if s]) <= 6 and state.count("```python") == 1
    assert "tied.jit" in block and "assert" in block
    assert not re.search(r"\d+ passed|\d+ tests", text)  # counts go stale: read them from the run


def test_every_relative_link_of_the_readme_is_a_file():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10
    assert [link for link in local if not (ROOT / link).is_file()] == []
