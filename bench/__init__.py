"""The dsv4_compile benchmark suite: `python -m bench --quick | --full | --smoke --out DIR`.

The repository root must not be on sys.path while the suite runs: its top-level `kernels/`
folder would shadow the name `kernels` that transformers probes at import (the Hugging Face
kernels package) and load the dsv4 kernels a second time under another name. `python -m bench`
puts the working directory first on sys.path, so the root is dropped here; the package's own
submodules import through `bench.__path__` and dsv4_compile through its installation.
"""
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _ROOT]
