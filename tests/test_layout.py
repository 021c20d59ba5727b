"""The package's layout: no import circle among hf_vla's modules, deferred (function-level) imports and those under
`if TYPE_CHECKING:` included (a circle hidden there is still two modules that each need the other), no import circle among its rooms (folders), and the rooms a user would name (training, data, models, evaluation, serving, hub,
envs, rl) holding the code."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "hf_vla"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the hf_vla modules it imports anywhere in its body (a function's deferred imports and those under
    `if TYPE_CHECKING:` too)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # `from pkg import mod` imports the module mod; `from pkg import name` the package
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                           for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 40 and sum(map(len, graph.values())) > 100  # the graph was built from the real package
    found = cycles(graph)
    assert not found, "import cycles among hf_vla's modules (each group imports itself through the others):\n" + \
        "\n".join(" <-> ".join(group) for group in found)


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """room -> the rooms its modules import (the top-level modules, commands and shared helpers, left out: every
    room may use them and they are the rooms' entry points)."""
    def room(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None

    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = room(module)
        if source is not None:
            rooms.setdefault(source, set()).update(t for t in map(room, targets) if t not in (None, source))
    for targets in list(rooms.values()):
        for target in targets:
            rooms.setdefault(target, set())
    return rooms


def test_no_room_imports_a_room_that_imports_it_back():
    """Folders in layers (issue #93): the registries and the deployment contract at the bottom, envs below evaluation,
    hub below serving; deferred imports counted."""
    rooms = folder_graph(import_graph())
    assert {"registry", "deployment", "envs", "evaluation", "hub", "serving"} <= set(rooms)
    found = cycles(rooms)
    assert not found, "rooms that import each other:\n" + "\n".join(" <-> ".join(group) for group in found)


def test_no_top_level_module_and_room_import_each_other():
    """The top-level modules (commands, public doors, shared helpers) counted as rooms too: none imports a room that
    imports it back (issue #108: `lora` <-> `training`, `parser` <-> `training` were such pairs)."""
    graph = import_graph()
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = module.split(".")[1] if "." in module else None
        if source is not None:
            rooms.setdefault(source, set()).update(t.split(".")[1] for t in targets if "." in t)
    pairs = sorted({tuple(sorted((a, b))) for a, targets in rooms.items() for b in targets
                    if b != a and a in rooms.get(b, set())})
    assert not pairs, f"modules or rooms importing each other: {pairs}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_top_level_holds_the_commands_and_public_entry_modules_only():
    """Library code lives in the rooms; the top level is the package, its commands (`python -m hf_vla.<command>`)
    and the modules the README and notebooks import."""
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert top == ["__init__", "__main__", "cli", "convert", "demo", "errors", "evaluate", "lora", "parser", "record",
                   "serve", "storage", "tiny", "train"], top
    rooms = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert rooms == ["data", "deployment", "envs", "evaluation", "hub", "models", "recap", "registry", "rl", "serving", "training"], rooms


# transformers' interfaces, whose parameters are fixed from outside: a model's `forward` / `sample_actions` take the
# batch's keys as keywords (the batch contract: `model(**batch)`), a decoder layer's `forward` is `GemmaDecoderLayer`'s,
# and a processor's `__init__` / `__call__` take what `processor_config.json` saves and what a caller passes per call;
# likewise a gymnasium env's `__init__` takes `gym.make(id, **kwargs)`'s keywords
TRANSFORMERS_INTERFACES = {
    ("envs/reach.py", "__init__"),
    ("models/pi05/modeling_pi05.py", "forward"), ("models/pi05/modeling_pi05.py", "sample_actions"),
    ("models/pi05/processing_pi05.py", "__init__"), ("models/pi05/processing_pi05.py", "__call__"),
    ("models/pi0_adapter.py", "__init__"),
}
MAX_PARAMETERS = 8


def wide_functions(package: Path = PACKAGE) -> list[tuple[str, str, int]]:
    """(file, function, parameters) of every function of the package with more than `MAX_PARAMETERS` parameters
    (self and cls not counted; *args and **kwargs count one each)."""
    wide = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                count = len(names) + bool(a.vararg) + bool(a.kwarg)
                if count > MAX_PARAMETERS:
                    wide.append((path.relative_to(package).as_posix(), node.name, count))
    return wide


def test_no_function_takes_more_than_eight_parameters():
    """Resolved settings objects travel whole (`EvaluateArguments`, `RecordArguments`, `StreamSettings`, ...), as TRL
    passes `args=`: no unpacked field lists, except transformers' own interfaces."""
    wide = [(path, name, count) for path, name, count in wide_functions()
            if (path, name) not in TRANSFORMERS_INTERFACES]
    assert not wide, f"functions with more than {MAX_PARAMETERS} parameters (pass a settings object): {wide}"


def test_the_signature_count_sees_a_wide_function(tmp_path):
    (tmp_path / "wide.py").write_text("def f(a, b, c, d, e, f, g, h, *rest, **options):\n    pass\n"
                                      "def g(self, a, b, c, d, e, f, g, h):\n    pass\n")
    assert wide_functions(tmp_path) == [("wide.py", "f", 10)]


# the value model is pi0.5 with a value head: its config extends pi0.5's (as a transformers model composes another's)
FAMILY_IMPORTS_ALLOWED = {("value", "pi05")}


def test_no_model_family_imports_another_familys_folder():
    """Code policies share lives in `hf_vla/models/common/` (carried by every checkpoint's remote code); a family's
    folder or module imports no other family's."""
    models = PACKAGE / "models"
    families = {p.name for p in models.iterdir() if p.is_dir() and p.name not in ("common", "__pycache__")}
    families |= {p.stem for p in models.glob("*.py") if p.stem not in ("__init__", "auto", "reference")}
    found = []
    for family in sorted(families):
        paths = sorted((models / family).rglob("*.py")) if (models / family).is_dir() else [models / f"{family}.py"]
        for path in paths:
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                module = ("." * node.level) + (node.module or "")
                target = module.removeprefix("hf_vla.models.").removeprefix("..").removeprefix(".").split(".")[0]
                if node.level == 1 and (models / family).is_dir():
                    continue  # its own folder
                if target in families and target != family and (family, target) not in FAMILY_IMPORTS_ALLOWED:
                    found.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not found, found
