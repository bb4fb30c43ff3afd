"""Layering: app -> autotune -> runtime -> kernels, never back up; the core never imports the UI toolkit; importing
has no side effects; the import names are the `tandem` package's own (checked in clean interpreters)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ["app", "autotune", "runtime", "kernels"]  # top to bottom: each may import only the floors below it


def modules(floor: str) -> list[str]:
    return sorted(
        f"tandem.{floor}." + ".".join(p.relative_to(ROOT / floor).with_suffix("").parts)
        for p in (ROOT / floor).rglob("*.py")
        if p.name != "__init__.py"
    )


def test_core_packages_do_not_import_textual() -> None:
    core = [m for floor in ("runtime", "kernels", "autotune") for m in modules(floor)]
    code = (
        "import importlib, sys\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(name)\n"
        "assert not [m for m in sys.modules if m == 'textual' or m.startswith('textual.')], 'textual imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_no_import_runs_up_a_floor() -> None:
    wrong = []
    for i, floor in enumerate(FLOORS):
        above = {f"tandem.{f}" for f in FLOORS[:i]}
        for path in (ROOT / floor).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                wrong += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if any(n == a or n.startswith(a + ".") for a in above)]
    assert not wrong


def test_importing_packages_has_no_side_effects() -> None:
    code = "import sys, tandem.app, tandem.runtime, tandem.kernels, tandem.autotune\nassert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_command_lines_flags_load_no_torch() -> None:
    """Every command's parser (its flags' choices list the families and their bench shapes) is built without torch:
    `tandem --help` answers at once, and what the command line sets for torch's runtime comes before torch."""
    code = ("import sys, tandem.app.cli.main as m\nm.build_parser()\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_import_names_cannot_be_shadowed(tmp_path: Path) -> None:
    """Another distribution's top-level `kernels` (Hugging Face's kernel hub) or `app` on the path changes nothing:
    Tandem's code imports only `tandem.*`, and the other package stays what it is."""
    for name in ("kernels", "app", "runtime", "autotune"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("OTHER = True\n")
    code = (
        "import kernels, app, tandem.kernels.experts, tandem.app.cli.main, tandem.runtime.loader, tandem.autotune.run\n"
        "assert kernels.OTHER and app.OTHER\n"
        "import sys\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('runtime', 'autotune')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=tmp_path)
    for floor in FLOORS:
        for path in (ROOT / floor).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    assert node.module.split(".")[0] not in FLOORS, f"{path}: from {node.module}"
                if isinstance(node, ast.Import):
                    assert not [a for a in node.names if a.name.split(".")[0] in FLOORS], path


def test_every_package_folder_is_installed() -> None:
    """A wheel holds only the packages pyproject.toml lists (the editable install would hide a missing one)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"tandem." + ".".join(p.parent.relative_to(ROOT).parts) for floor in FLOORS
             for p in (ROOT / floor).rglob("__init__.py")}
    assert listed == found
