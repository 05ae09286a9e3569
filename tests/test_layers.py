"""The package's layering, kept by parsing every import (module-level and function-local).

Layers, bottom up (a module may import its own layer and the layers below, never above):
0. ``treeops.tree`` and the private modules ``treeops._*``: shared types, checks, runtime facts;
1. ``treeops.kernels.*`` (Triton kernels and launchers) and ``treeops.reference.*`` (the spec);
2. the public ops ``treeops.<op>`` and public tooling (``treeops.testing``);
3. the package root, the example decoder, the CLI and the demo.
Inside the package, a function-local import of another treeops module is refused too: it would
hide an arrow (or a cycle) from a reader. The CLI's lazy imports of the demo and the decoder are
the one exception: they keep ``treeops --help`` from importing the models.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# installed name -> source directory (pyproject's package-dir)
PACKAGES = {"treeops": "treeops", "treeops.kernels": "kernels", "treeops.reference": "reference"}
TOP = {"treeops", "treeops.__main__", "treeops.cli", "treeops.demo"}
LAZY_OK = {("treeops.cli", "treeops.demo"), ("treeops.cli", "treeops.decoder.cli")}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, src in PACKAGES.items():
        for path in sorted((ROOT / src).rglob("*.py")):
            rel = path.relative_to(ROOT / src).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if pkg == "treeops" and parts and parts[0] in ("kernels", "reference"):
                continue
            mods[".".join([pkg, *parts])] = path
    return mods


MODULES = _modules()


def layer(mod: str) -> int:
    if mod in TOP or mod.startswith("treeops.decoder"):
        return 3
    if mod.startswith(("treeops.kernels", "treeops.reference")):
        return 1
    last = mod.split(".")[1]
    return 0 if last == "tree" or last.startswith("_") else 2


def _resolve(mod: str, path: Path, node: ast.ImportFrom) -> list[str]:
    if not node.level:
        base = node.module or ""
    else:
        pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([node.module] if node.module else []))
    # ``from treeops import kernels`` names a module; ``from .x import f`` names a function
    names = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    return names or [base]


def imports(mod: str) -> list[tuple[str, int, bool]]:
    """(imported treeops module, line, function-local?) for every import in ``mod``."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    local = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            targets = _resolve(mod, path, node)
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t == "treeops" or t.startswith("treeops."):
                while t not in MODULES and "." in t:
                    t = t.rsplit(".", 1)[0]
                out.append((t, node.lineno, id(node) in local))
    return out


def test_every_module_is_classified():
    assert {"treeops.tree", "treeops.kernels.accept", "treeops.reference.accept"} <= set(MODULES)
    assert layer("treeops._runtime") == 0 and layer("treeops.kernels.accept") == 1
    assert layer("treeops.tree_attention") == 2 and layer("treeops.decoder.engine") == 3


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_no_upward_import(mod):
    up = [
        f"{MODULES[mod].relative_to(ROOT)}:{line} imports {t} (layer {layer(t)} > {layer(mod)})"
        for t, line, _ in imports(mod)
        if layer(t) > layer(mod)
    ]
    assert not up, "\n".join(up)


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_no_function_local_import(mod):
    hidden = [
        f"{MODULES[mod].relative_to(ROOT)}:{line} imports {t} inside a function"
        for t, line, is_local in imports(mod)
        if is_local and (mod, t) not in LAZY_OK
    ]
    assert not hidden, "\n".join(hidden)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The parser is not vacuous: a kernel importing a public op is caught."""
    fake = tmp_path / "fake.py"
    fake.write_text("from treeops.graft import graft\n\ndef f():\n    from treeops import demo\n")
    monkeypatch.setitem(MODULES, "treeops.kernels.fake", fake)
    found = imports("treeops.kernels.fake")
    assert ("treeops.graft", 1, False) in found and ("treeops.demo", 4, True) in found
    assert any(layer(t) > 1 for t, _, _ in found)
