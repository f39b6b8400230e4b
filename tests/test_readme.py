"""Every Python block of the README runs as written, top to bottom, and its claims hold.

Blocks run in order in one namespace (a later block may continue an earlier one, as the
training block continues the seed example). Blocks that use several devices (a `Mesh`,
`tied.data_parallel`) run the same way in a separate process with 8 fake CPU devices.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import tied

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def multi_device(block: str) -> bool:
    return "data_parallel(" in block or "Mesh(" in block


def test_the_readme_has_the_blocks_this_test_expects():
    blocks = python_blocks()
    assert len(blocks) >= 8
    assert sum(map(multi_device, blocks)) >= 2


def test_every_single_device_block_runs_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files the blocks write land here
    namespace: dict = {"__name__": "readme"}
    for k, block in enumerate(python_blocks()):
        if multi_device(block):
            continue
        code = block.replace("/tmp/", f"{tmp_path}/")
        exec(compile(code, f"README.md block {k}", "exec"), namespace)  # its asserts must hold
        if k == 0:  # the seed example: its model and gradient are tied as it says
            c, g = namespace["c"], namespace["g"]
            assert g.layers[0].weight is g.layers[1].weight
            pairs = [(".layers[0].weight", ".layers[1].weight"), (".layers[0].bias", ".layers[1].bias")]
            assert tied.ties(c) == pairs


def test_every_multi_device_block_runs_on_8_fake_devices(tmp_path):
    blocks = [b for b in python_blocks() if multi_device(b)]
    script = tmp_path / "readme_multi.py"
    body = "\n".join(
        f"exec(compile({b!r}, 'README.md multi-device block {k}', 'exec'), ns)" for k, b in enumerate(blocks)
    )
    script.write_text(
        textwrap.dedent(
            """
            import jax
            assert jax.device_count() == 8, jax.devices()
            ns = {"__name__": "readme"}
            """
        )
        + body
        + "\nprint('README multi-device blocks ok')\n"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "README multi-device blocks ok" in out.stdout
