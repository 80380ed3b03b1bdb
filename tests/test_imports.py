"""Imports point downhill: model <- kernels <- quant <- engine <- server, each layer importing only
those below it, read off every module's import statements; no two files import each other, however far round;
engine/'s rooms keep their directions; and importing a layer builds nothing."""

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
    "replicas": {"api", "server", "engine", "quant", "kernels", "model"},  # the server's app over Ray Serve replicas
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path) for path in PACKAGE.rglob("*.py")}


def imported_modules(path: Path) -> set[str]:
    """Every inferlab module a file imports, at module level or inside a function, relative imports resolved;
    `from package import module` imports that module (the package's __init__ runs for any of its modules)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module)
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


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively): each a set of
    files that import each other, however far round."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            module, targets = work[-1]
            target = next((t for t in targets if t in graph), None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = stack[stack.index(module) :]
                    del stack[stack.index(module) :]
                    if len(component) > 1:
                        found.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                work.append((target, iter(sorted(graph[target]))))
            elif target in stack:
                low[module] = min(low[module], index[target])
    return found


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back_however_far_round():
    assert not circles(import_graph())


def engine_room(module: str) -> str:
    """inferlab.engine.kv.paged -> kv; a module at engine/'s top (the loop, the scheduler, ...) -> its own name."""
    return module.split(".")[2] if module.startswith("inferlab.engine.") else ""


# engine/'s sub-rooms and the other engine rooms each may import: KV memory and the loop's runtime know nothing of
# the rest; speculation and the references run over the KV memory and the model runner, never the loop
ENGINE_ROOMS = {
    "kv": set(),
    "runtime": set(),
    "spec": {"kv", "runtime", "model_runner", "request", "sampling", "logits", "stop", "scheduler"},
    "reference": {"kv", "runtime", "model_runner", "request", "sampling", "logits", "stop"},
}


@pytest.mark.parametrize("room", sorted(ENGINE_ROOMS))
def test_each_engine_room_imports_only_what_it_stands_on(room):
    allowed = {room} | ENGINE_ROOMS[room]
    wrong = {
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if engine_room(module) == room
        for target in targets
        if layer_of(target) == "engine" and engine_room(target) not in allowed
    }
    assert not wrong, sorted(wrong)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def test_the_engine_loop_never_reaches_the_references_and_nothing_in_engine_imports_its_front_door():
    graph = import_graph()
    assert not {m for m in reachable(graph, "inferlab.engine.loop") if engine_room(m) == "reference"}
    assert not {m for m, targets in graph.items() if layer_of(m) == "engine" and "inferlab.engine.engine" in targets}


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


def test_serving_and_its_command_line_import_no_ray():
    """Ray is the replicas extra's: the server, its command and the package's front door run without it (a module
    that imports ray on the way would fail there), and only inferlab-serve-replicas reaches for it."""
    probe = (
        "import json, sys, inferlab, inferlab.api, inferlab.serve, inferlab.server, inferlab.serve_replicas; "
        "print(json.dumps(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'inferlab.replicas')))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
