"""The package's shape: no import circles, dependencies in one direction, a front door that opens fast.

Layers, lowest first (docs/architecture.md): errors/files -> config/device -> run.weights/engine -> model/data ->
search -> train -> run.directory -> decode -> interop/viz/eval -> serve -> cli (the run package, aiayn.run, holds
the run's weight files and the choice of its inference weights on floor 2, who owns it on floor 3 and the loaded
run on floor 6). A module may import its own layer or a lower one,
never a higher one, not even inside a function; no exception. Inference (run, decode, interop, serve) never imports
the training code: it opens weight files through aiayn.run.weights.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "aiayn"
BENCHMARKS = PKG.parent / "benchmarks"

LAYERS = {
    "aiayn.errors": 0, "aiayn.files": 0, "aiayn.progress": 0, "aiayn.launched": 0,
    "aiayn.config": 1, "aiayn.cpu_probe": 1, "aiayn.device": 1, "aiayn.task": 1,
    "aiayn.run": 2, "aiayn.run.weights": 2, "aiayn.engine": 2, "aiayn.linear": 2,
    "aiayn.model": 3, "aiayn.data": 3, "aiayn.run.ownership": 3,
    "aiayn.search": 4,
    "aiayn.train": 5,
    "aiayn.run.directory": 6,
    "aiayn.decode": 7,
    "aiayn.interop": 8, "aiayn.viz": 8, "aiayn.eval": 8,
    "aiayn.serve": 9, "aiayn.table3": 9, "aiayn.runner": 9, "aiayn.sweep": 9,
    "aiayn.cli": 10, "aiayn.cli_flags": 10, "aiayn.demo": 10, "aiayn.launch": 10, "aiayn.__main__": 10, "aiayn": 10,
}
# Packages that must not reach the training code although it sits below them: loading, decoding, exporting
# and serving a run need its weight files (aiayn.run.weights), not the trainer.
INFERENCE = ("aiayn.run", "aiayn.decode", "aiayn.interop", "aiayn.serve")


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = PKG) -> dict[str, Path]:
    return {module_name(p): p for p in root.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of its own package (aiayn, benchmarks) that ``name`` imports anywhere in its file (module level
    and inside functions)."""
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                mod = f"{anchor}.{node.module}" if node.module else anchor
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for t in targets:
            if t.split(".")[0] != name.split(".")[0]:
                continue
            # the longest known module that the name starts with (a submodule or the package itself)
            while t and t not in known:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name:
                out.add(t)
    return out


def layer(name: str) -> int:
    while name not in LAYERS:
        name = name.rsplit(".", 1)[0]
    return LAYERS[name]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    # Under TYPE_CHECKING the package __init__ names classes for annotations only; it imports lazily.
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def test_no_import_circles(graph):
    circles = circles_of(graph)
    # A package __init__ that re-exports its submodules is not a circle with them.
    circles = [c for c in circles if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert circles == []


def test_dependencies_point_down(graph):
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                    if layer(t) > layer(m) and not t.startswith(m + "."))
    assert upward == []


def package(name: str) -> str:
    """The top-level unit of a module: aiayn.train.trainer -> aiayn.train; aiayn.config -> aiayn.config."""
    return ".".join(name.split(".")[:2])


def circles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more nodes (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_in_the_benchmarks():
    """benchmarks/ is checked as aiayn/ is, an import inside a function counted (gpu_check <-> gpu_training, the
    last circle, was one)."""
    mods = modules(BENCHMARKS)
    bench = {m: imports_of(m, p, set(mods)) for m, p in mods.items()}
    assert "benchmarks.gpu_training" in bench["benchmarks.gpu_check"]  # the graph is not vacuous
    assert "benchmarks.data_scale" in bench["benchmarks.gpu_training"]  # imports inside functions count
    assert circles_of(bench) == []


def test_no_import_circles_between_packages(graph):
    packages: dict[str, set[str]] = {}
    for m, targets in graph.items():
        if m == "aiayn":  # the front door imports (lazily) from everything; nothing imports it back
            continue
        packages.setdefault(package(m), set()).update(package(t) for t in targets if package(t) != package(m))
    assert circles_of(packages) == []


def test_inference_never_imports_the_training_code(graph):
    reached = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                     if package(m) in INFERENCE and package(t) == "aiayn.train")
    assert reached == []


def test_decoding_batches_without_the_training_batching(graph):
    """The search cuts and pads its own batches (aiayn.search.sources, .common): training's cost formula is not
    inference's, and nothing that decodes or serves reaches it."""
    reached = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                     if package(m) in ("aiayn.search", *INFERENCE) and t == "aiayn.data.batching")
    assert reached == [] and "aiayn.data.batching" in graph["aiayn.train.update"]


def test_every_module_has_a_layer_and_the_graph_is_not_vacuous(graph):
    assert all(layer(m) >= 0 for m in graph)  # a new package must be placed in LAYERS (layer() raises else)
    assert "aiayn.config" in graph["aiayn.train.trainer"]
    assert "aiayn.decode.open_run" in graph["aiayn.eval.evaluate"]
    assert "aiayn.run.weights" in graph["aiayn.run.directory"]
    assert layer("aiayn.decode.translator") > layer("aiayn.run.directory") > layer("aiayn.run.weights")


def test_search_and_decoding_functions_take_at_most_8_parameters():
    """Options travel as one object (DecodeOptions, SearchSpec), not as long parameter lists."""
    wide = []
    for path in [*(PKG / "search").rglob("*.py"), *(PKG / "decode").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                n = len(names) - (names[:1] in (["self"], ["cls"])) + (a.vararg is not None) + (a.kwarg is not None)
                if n > 8:
                    wide.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name} ({n})")
    assert wide == []


def test_help_imports_no_torch():
    """`aiayn --help` and the parser never import PyTorch, which is what keeps them fast (the time itself is
    measured by ``python -m benchmarks.cli_startup``, not asserted here: a busy machine would fail it)."""
    code = ("import sys; from aiayn.cli import build_parser; build_parser(); print('torch' in sys.modules); "
            "from aiayn.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.split()[0] == "False" and "usage:" in r.stdout
    assert r.stderr.strip() == "False"  # the parser alone never pulls PyTorch in, nor does printing the help


def test_version_is_one_string(capsys):
    import importlib.metadata

    import aiayn
    from aiayn import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"aiayn {aiayn.__version__}"
    try:
        assert importlib.metadata.version("aiayn") == aiayn.__version__  # pyproject reads it from the package
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        pytest.skip("aiayn is not installed")


def test_every_package_face_is_in_the_architecture_doc_and_holds_no_code():
    """docs/architecture.md's table of faces names each package's ``__init__.py``, and a face holds a docstring and
    re-exports only: no function or class (the front door's ``load`` and lazy ``__getattr__`` aside)."""
    doc = (PKG.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = doc.split("## The packages' faces", 1)[1].split("\n## ", 1)[0]
    named = {name.strip().strip("`") for line in table.splitlines() if line.startswith("| `")
             for name in line.split("|")[1].split(",")}
    faces = sorted(PKG.rglob("__init__.py"))
    missing = [str(p.relative_to(PKG.parent)) for p in faces
               if ("aiayn/" if p.parent == PKG else f"{p.parent.name}/") not in named]
    assert not missing, f"not in docs/architecture.md's table of faces: {missing}"
    code = []
    for path in faces:
        allowed = {"load", "__getattr__"} if path.parent == PKG else set()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name not in allowed:
                code.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name}")
    assert len(faces) >= 10 and not code, code

def test_every_module_is_named_in_the_architecture_doc():
    """docs/architecture.md's "Every module" table names each module of aiayn/ (the map is the tree)."""
    doc = (PKG.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = doc.split("## Every module", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip().strip("`"): line for line in table.splitlines() if line.startswith("| `")}
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        package = "aiayn/" if path.parent == PKG else f"{path.parent.name}/"
        if f"`{path.name}`" not in rows.get(package, ""):
            missing.append(str(path.relative_to(PKG.parent)))
    assert not missing, f"not in docs/architecture.md's module table: {missing}"


def test_no_function_takes_more_than_eight_parameters():
    """Wide signatures become option objects (DecodeOptions, EvalData, TokenizerSpec, SpecialIds, Update): no
    function in aiayn/ or benchmarks/ takes more than 8 parameters (self/cls aside; *args and **kwargs count one)."""
    wide = []
    for root in (PKG, PKG.parent / "benchmarks"):
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                    count = len(names) + bool(a.vararg) + bool(a.kwarg)
                    if count > 8:
                        wide.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({count})")
    assert not wide, wide


def positional_dataclasses(tree: ast.AST) -> list[str]:
    """``name:line (n fields)`` of each dataclass in ``tree`` with more than 8 fields that is not keyword-only."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for dec in node.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            if (target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")) != "dataclass":
                continue
            fields = [x for x in node.body if isinstance(x, ast.AnnAssign) and isinstance(x.target, ast.Name)
                      and "ClassVar" not in ast.unparse(x.annotation)]
            kw_only = isinstance(dec, ast.Call) and any(k.arg == "kw_only" and isinstance(k.value, ast.Constant)
                                                        and k.value.value is True for k in dec.keywords)
            if len(fields) > 8 and not kw_only:
                out.append(f"{node.name}:{node.lineno} ({len(fields)} fields)")
    return out


def wide_calls(tree: ast.AST) -> list[str]:
    """``callee:line (n)`` of each call in ``tree`` that passes more than 8 arguments by position (``*args`` aside)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            n = sum(not isinstance(a, ast.Starred) for a in node.args)
            if n > 8:
                out.append(f"{ast.unparse(node.func)}:{node.lineno} ({n})")
    return out


def test_wide_dataclasses_are_keyword_only():
    """A parameter object of more than 8 fields is built by keyword (``@dataclass(kw_only=True)``): two neighbouring
    fields passed by position can swap silently, and no test notices (ServeOptions, Completion, Update...)."""
    found = [f"{path.relative_to(PKG.parent)} {c}" for root in (PKG, PKG.parent / "benchmarks")
             for path in sorted(root.rglob("*.py")) for c in positional_dataclasses(ast.parse(path.read_text("utf-8")))]
    assert not found, found


def test_no_call_passes_more_than_eight_positional_arguments():
    """The call side: nowhere in aiayn/ does a call pass more than 8 arguments by position (``*args`` aside); past
    that, a reader counts commas to know which value is which."""
    found = [f"{path.relative_to(PKG.parent)} {c}" for path in sorted(PKG.rglob("*.py"))
             for c in wide_calls(ast.parse(path.read_text("utf-8")))]
    assert not found, found


def test_the_width_rules_find_what_they_refuse():
    fields = "".join(f"    f{i}: int\n" for i in range(9))
    wide = ast.parse(f"@dataclass(frozen=True)\nclass A:\n{fields}\nA(1, 2, 3, 4, 5, 6, 7, 8, 9)\nf(*xs, 1, 2)\n")
    assert positional_dataclasses(wide) == ["A:2 (9 fields)"] and wide_calls(wide) == ["A:13 (9)"]
    ok = ast.parse(f"@dataclasses.dataclass(kw_only=True)\nclass B:\n{fields}    c: ClassVar[int] = 0\n"
                   "@dataclass\nclass C:\n" + "".join(f"    g{i}: int\n" for i in range(8)))
    assert positional_dataclasses(ok) == [] and wide_calls(ok) == []


def test_no_function_is_longer_than_sixty_lines():
    """A function reads on a screen: none in aiayn/ or benchmarks/ over 60 lines (docstring included); the
    server's routes are split into functions of their classes and modules (issue 43), the longest functions into
    named helpers (issue 63)."""
    long = []
    for root in (PKG, PKG.parent / "benchmarks"):
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 60:
                        long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_the_shares_of_files_run_alone_cover_every_file_once():
    """tests/alone.py (make test-alone) deals the test files into shares, one a day: together they hold every
    file of the suite, each once, so every file runs alone within SHARES days."""
    import alone  # tests/ is on sys.path under pytest

    files = alone.test_files()
    assert len(files) > 30 and not {f.name for f in files} & set(alone.OWN_TARGETS)
    shares = [alone.share_of(files, f"{k}/{alone.SHARES}")[0] for k in range(1, alone.SHARES + 1)]
    assert sorted(f for share in shares for f in share) == files
    today, name = alone.share_of(files, "today")
    assert today in shares and name.endswith(f"/{alone.SHARES}")
    assert alone.share_of(files, "all")[0] == files
