"""Repository contracts: the README's commands, CI, and the package layout."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_command():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert "dsv4-compile demo" in demo
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line and not line.startswith(("#", "set ", "cd "))]
    assert ci_lines == [tests]


def test_only_dsv4_compile_is_an_import_name():
    import dsv4_compile.kernels
    import dsv4_compile.lowerings
    import dsv4_compile.passes

    assert Path(dsv4_compile.passes.__file__).parent == ROOT / "passes"
    assert Path(dsv4_compile.kernels.__file__).parent == ROOT / "kernels"
    assert Path(dsv4_compile.lowerings.__file__).parent == ROOT / "lowerings"
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"packages = \[(.*?)\]", pyproject, flags=re.S).group(1)
    assert all(name.strip().strip('"').startswith("dsv4_compile") for name in packages.split(",") if name.strip())
    # Installed or not, the top-level folders must not be importable as packages of their own
    # from outside the repository.
    for name in ("passes", "kernels", "lowerings"):
        spec = importlib.util.find_spec(name)
        assert spec is None or Path(spec.origin or "").parent.parent == ROOT


_TOP_LEVEL_KERNELS_PROBE = r"""
import importlib, sys
sys.path.insert(0, sys.argv[1])
def copies():
    return [m for m in sys.modules if m.startswith("kernels.")]
importlib.import_module("kernels")  # transformers' probe for the Hugging Face package
assert copies() == [], copies()
import torch
import dsv4_compile.kernels.fp4_moe as moe
assert copies() == [], copies()

class Seen(Exception):
    pass

def patched(*args, **kwargs):
    raise Seen
moe.fp4_moe_pairs_triton = patched
x = torch.randn(1, 64)
ids, weights = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
w13, s13 = torch.randint(0, 256, (1, 64, 32), dtype=torch.uint8), torch.full((1, 64, 2), 127, dtype=torch.uint8)
w2, s2 = torch.randint(0, 256, (1, 64, 16), dtype=torch.uint8), torch.full((1, 64, 1), 127, dtype=torch.uint8)
try:
    torch.ops.dsv4.fp4_moe_pairs(x, ids, weights, w13, s13, w2, s2, "mxfp4", None, None, None)
except Seen:
    print("served by dsv4_compile.kernels")
"""


def test_kernels_folder_imported_as_top_level_kernels_registers_nothing():
    """With the checkout root first on sys.path, `import kernels` (as transformers does to probe for
    the Hugging Face package) must not load a second copy of the kernel modules: the dsv4 ops must
    run dsv4_compile.kernels' code, so that a patch of it (a bench experiment, a config) applies."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _TOP_LEVEL_KERNELS_PROBE, str(ROOT)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("served by dsv4_compile.kernels"), done.stdout[-2000:]
