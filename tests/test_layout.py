"""The package's layout holds: imports flow one way, from the command line down to the communicators, and
no two modules import each other, however indirectly.

Read from the source (every `import` and `from ... import`, those inside functions too), so a lazy import
that would close a circle, or a room reaching up into one above it, fails here rather than in a review.
docs/architecture.md draws the same picture.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "xtrain_dist"

# Each room may import its own layer and the layers below it, never one above. A room is a subpackage or a
# top-level module, named by its first component under xtrain_dist.
LAYERS = [
    # the thin entry modules of `python -m`
    {"train_ddp", "evaluate", "sample", "hellaswag", "tokenize_corpus", "prepare_hellaswag", "plot_metrics", "plan"},
    {"train", "planner"},                                   # the training command; the planner
    {"bench"},                                              # the benchmarks' shared code and PyTorch peer
    {"eval", "parallel", "checkpoint", "data"},             # what the loop calls
    {"model", "layout", "optim", "backend"},                # the model, its layout, its optimizer, its ops
    {"comm", "config", "files", "errors", "precision", "command", "profile", "shipped", "config_file",
     "__init__"},
]
LAYER_OF = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the xtrain_dist modules it imports (a `from package import name` counts as importing the
    submodule `name` where there is one, else the package)."""
    paths = {module_name(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        parent = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = parent.split(".")[:len(parent.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                imported |= {f"{source}.{a.name}" if f"{source}.{a.name}" in paths else source for a in node.names}
        graph[name] = {m for m in imported if m in paths and m != name}
    return graph


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} ({room(m)}) imports {d} ({room(d)})" for m, deps in sorted(graph.items())
            for d in sorted(deps) if LAYER_OF[room(d)] < LAYER_OF[room(m)]]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The sets of modules that import each other, directly or not (Tarjan's strongly connected components
    of more than one module)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    assert sorted({room(m) for m in import_graph()} - set(LAYER_OF)) == []


def test_imports_flow_one_way():
    assert upward_imports(import_graph()) == []


def test_evaluation_never_imports_training():
    """eval/ serves the training loop and its own commands: it must not need the training command."""
    assert [f"{m} -> {d}" for m, deps in import_graph().items() if room(m) == "eval"
            for d in deps if room(d) == "train"] == []


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_checks_see_a_lazy_circle_and_an_upward_import(tmp_path):
    """What the checks above would catch: errors.py importing train/ inside a function (upward, and with
    train/loop.py's import of errors, a circle), written with relative imports of two levels."""
    fake = tmp_path / "xtrain_dist"
    (fake / "train").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "errors.py").write_text("def f():\n    from .train import loop\n")
    (fake / "train" / "__init__.py").write_text("")
    (fake / "train" / "loop.py").write_text("from ..errors import f\n")
    graph = import_graph(fake)
    assert graph["xtrain_dist.errors"] == {"xtrain_dist.train.loop"}
    assert graph["xtrain_dist.train.loop"] == {"xtrain_dist.errors"}
    assert upward_imports(graph) == ["xtrain_dist.errors (errors) imports xtrain_dist.train.loop (train)"]
    assert circles(graph) == [["xtrain_dist.errors", "xtrain_dist.train.loop"]]
