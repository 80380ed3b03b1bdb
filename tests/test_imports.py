"""Imports point downhill: model <- kernels <- quant <- engine <- server, each layer importing only
those below it, read off every module's import statements; and importing a layer builds nothing."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import inferlab

PACKAGE = Path(inferlab.__file__).parent
LEAVES = {"errors", "native_memory", "paths"}  # one-file modules every layer may use; they import no inferlab module
BELOW = {  # each layer and the layers it may import, besides itself and the leaves
    "model": set(),
    "kernels": {"model"},
    "quant": {"kernels", "model"},
    "engine": {"quant", "kernels", "model"},
    "server": {"engine", "quant", "kernels", "model"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every inferlab module a file imports, at module level or inside a function, relative imports resolved."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            if module == "inferlab":  # `from inferlab import engine` imports inferlab.engine
                found.update(f"inferlab.{alias.name}" for alias in node.names)
            else:
                found.add(module)
    return {name for name in found if name == "inferlab" or name.startswith("inferlab.")}


def layer_of(module: str) -> str:
    """inferlab.quant.int4 -> quant; the package itself -> "inferlab" (its __init__ reaches the engine)."""
    return module.split(".")[1] if "." in module else module


def import_graph() -> dict[str, set[str]]:
    return {module_name(path): imported_modules(path) for path in sorted(PACKAGE.rglob("*.py"))}


def test_the_walk_sees_every_module_and_their_imports():
    graph = import_graph()
    assert {"inferlab.kernels.fused_decode", "inferlab.quant.int4", "inferlab.engine.engine"} <= graph.keys()
    assert "inferlab.kernels.gemv" in graph["inferlab.quant.int8"]
    assert "inferlab.engine.engine" in graph["inferlab.api"]


@pytest.mark.parametrize("layer", sorted(BELOW))
def test_each_layer_imports_only_the_layers_below_it(layer):
    allowed = {layer} | BELOW[layer] | LEAVES
    uphill = {
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if layer_of(module) == layer
        for target in targets
        if layer_of(target) not in allowed
    }
    assert not uphill, sorted(uphill)


def test_leaves_import_no_inferlab_module():
    graph = import_graph()
    assert not {leaf: graph[f"inferlab.{leaf}"] for leaf in LEAVES if graph[f"inferlab.{leaf}"]}


def test_importing_quant_builds_no_kernels_and_loads_no_engine(tmp_path):
    """A fresh interpreter with an empty cache: `import inferlab.quant` compiles nothing, loads no C++
    library and does not import the engine; the kernels build on the first call that needs them."""
    probe = (
        "import json, sys, torch, inferlab.quant; "
        "print(json.dumps({'modules': sorted(m for m in sys.modules if m.startswith('inferlab')), "
        "'libraries': sorted(torch.ops.loaded_libraries)}))"
    )
    env = {**os.environ, "INFERLAB_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "inferlab.quant.int4" in seen["modules"] and "inferlab.kernels.gemv" in seen["modules"]
    assert not [m for m in seen["modules"] if layer_of(m) == "engine"]
    assert not [lib for lib in seen["libraries"] if "inferlab" in lib]
    assert not (tmp_path / "cache").exists()
