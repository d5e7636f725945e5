"""The dsv4_compile benchmark suite: `python -m bench --quick | --full | --smoke --out DIR`.

The repository root must not be on sys.path while the suite runs: its `dsv4_compile/` folder
lacks the kernels, passes and lowerings that pyproject maps into the package, so ahead of a plain
(non-editable) installation it would shadow the installed package. `python -m bench` puts the
working directory first on sys.path, so the root is dropped here; the package's own submodules
import through `bench.__path__` and dsv4_compile through its installation.
"""
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _ROOT]
