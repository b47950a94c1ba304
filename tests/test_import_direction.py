"""The import direction of DESIGN.md, checked by parsing every module's imports."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"ktc": ROOT / "ktc", "ktc.formats": ROOT / "formats", "ktc.passes": ROOT / "passes",
            "ktc.runtime": ROOT / "runtime"}
# What each layer may import from ktc itself.
ALLOWED = {
    "ktc.ir": set(),
    "ktc.errors": set(),
    "ktc.formats": {"ktc.ir", "ktc.errors", "ktc.formats"},
    "ktc.passes": {"ktc.ir", "ktc.errors", "ktc.formats", "ktc.passes"},
    "ktc.runtime": {"ktc.ir", "ktc.errors", "ktc.formats", "ktc.runtime"},
}


def _modules():
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            yield name, path


def _ktc_imports(name: str, path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
    return {m for m in found if m == "ktc" or m.startswith("ktc.")}


def _layer(module: str) -> str | None:
    for layer in ("ktc.ir", "ktc.errors", "ktc.formats", "ktc.passes", "ktc.runtime"):
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def test_import_direction():
    violations = []
    for name, path in _modules():
        layer = _layer(name)
        if layer is None:
            continue  # the CLI, driver and API sit on top and may import anything
        for imported in _ktc_imports(name, path):
            if _layer(imported) not in ALLOWED[layer] and imported != name:
                violations.append(f"{name} imports {imported}")
    assert not violations, violations


def test_runtime_imports_without_cli_or_planner_dependencies():
    code = ("import sys, ktc.runtime, ktc.formats, ktc.ir; "
            "bad = {'click', 'networkx', 'transformers'} & set(sys.modules); print(sorted(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
