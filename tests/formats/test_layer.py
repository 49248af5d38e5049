"""shuttle.formats reads and writes files and never touches a model: no module of it imports a
layer above it (DESIGN.md's layers), not even lazily inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import shuttle.formats

# The packages shuttle.formats may use: the layers below it and the modules beside the layers.
ALLOWED = {"shuttle.kernels", "shuttle.patches", "shuttle.formats", "shuttle.errors",
           "shuttle.optional", "shuttle.hooks", "shuttle.version"}


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return [m for m in out if m == "shuttle" or m.startswith("shuttle.")]


def test_formats_import_no_layer_above_them():
    root = Path(shuttle.formats.__file__).parent
    above = {f"{p.name}: {m}" for p in sorted(root.glob("*.py")) for m in _imports(p)
             if ".".join(m.split(".")[:2]) not in ALLOWED}
    assert not above, sorted(above)
