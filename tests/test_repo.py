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
