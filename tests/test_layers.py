"""The package's folders are layers: each imports only the ones below it, and the package-level import graph has
no cycle. Computed from the sources with ``ast`` (imports inside functions count too), so a new upward import
fails here before it tangles the tree."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "swiftk"

# Built, not in the sources: the CUDA extension and the kernels folder (installed as swiftk.kernels).
BUILT = ["swiftk._C", "swiftk.kernels"]

# Lowest first. A unit is a top-level module or a subpackage (with everything under it); a unit imports only units
# of a lower layer, or of its own layer without a cycle.
LAYERS = [
    ("base", ["swiftk.errors", "swiftk.files", "swiftk.atomic", "swiftk.home", "swiftk.options", "swiftk.background",
              *BUILT]),
    ("runtime", ["swiftk.runtime"]),             # the model, weights, KV cache, masks, ops
    ("sample", ["swiftk.sample"]),               # logits processing, the sampler, the rejection sampler
    ("loading", ["swiftk.loading"]),             # GGUF, loaders, tokenizer, registry
    ("target", ["swiftk.target"]),               # what drafts are checked against: model, tokenizer, costs
    ("proposers", ["swiftk.proposers"]),         # draft sources and the model drafters' draft loop
    ("decoding", ["swiftk.decoding"]),           # the round, session, tree, acceptance, costs, learned state
    ("engine", ["swiftk.methods", "swiftk.requests", "swiftk.scheduler", "swiftk.calls", "swiftk.engine",
                "swiftk.api"]),
    ("serve", ["swiftk.serve"]),
    ("plugins", ["swiftk.moa", "swiftk.integrations"]),   # experimental methods, adapters to other engines:
                                                           # they import the core, the core never imports them
    ("front", ["swiftk.cli", "swiftk.skipset_search", "swiftk"]),   # the CLI, its offline skip-set search,
                                                                     # the package's lazy public names
]
LAYER_OF = {u: i for i, (_, units) in enumerate(LAYERS) for u in units}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set:
    """Every swiftk module or package ``path`` imports (relative imports resolved), at any depth of the file."""
    mod, is_pkg = module_name(path), path.name == "__init__.py"
    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            # `from pkg import x` imports module pkg.x when there is one, else pkg (x is a name in it)
            out |= {f"{target}.{a.name}" for a in node.names}
    return {m for m in out if m == "swiftk" or m.startswith("swiftk.")}


def sources() -> dict:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def unit(mod: str) -> str:
    for u in sorted(LAYER_OF, key=len, reverse=True):
        if mod == u or mod.startswith(u + "."):
            return u
    raise AssertionError(f"{mod} belongs to no layer: add it to LAYERS in {__file__}")


def package(mod: str, mods: dict) -> str:
    """The package a module lives in (a package is its own); swiftk's own top-level modules stand for themselves,
    as they sit in different layers (errors at the bottom, the engine near the top)."""
    if mod in BUILT or mods[mod].name == "__init__.py":
        return mod
    parent = mod.rsplit(".", 1)[0]
    return mod if parent == "swiftk" else parent


def edges(mods: dict, key) -> set:
    out = set()
    for m, p in mods.items():
        for t in imports(p):
            while t not in mods and t not in BUILT:   # pkg.name where name is an attribute: the module is pkg
                t = t.rsplit(".", 1)[0]
            a, b = key(m), key(t)
            if a != b:
                out.add((a, b, m, t))
    return out


def find_cycle(graph: dict):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for k in sorted(graph.get(n, ())):
            if state.get(k) == 1:
                return stack[stack.index(k):] + [k]
            if k not in state and (c := visit(k)):
                return c
        state[n] = 2
        stack.pop()

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_every_module_sits_in_a_layer():
    for m in sources():
        unit(m)


def test_no_import_runs_upward():
    mods = sources()
    upward = sorted(f"{m} imports {t} ({LAYERS[LAYER_OF[a]][0]} -> {LAYERS[LAYER_OF[b]][0]})"
                    for a, b, m, t in edges(mods, unit) if LAYER_OF[b] > LAYER_OF[a])
    assert not upward, "\n".join(upward)


def test_the_package_graph_has_no_cycle():
    mods = sources()
    for key in (unit, lambda m: package(m, mods)):
        graph: dict = {}
        for a, b, _, _ in edges(mods, key):
            graph.setdefault(a, set()).add(b)
        assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


MAX_FUNCTION_LINES = 80


def long_functions(source: str) -> list:
    """(name, lines) of each function (or method) of ``source`` longer than MAX_FUNCTION_LINES lines."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_over_80_lines():
    """A function a reader cannot hold at once is split by step (a module is split by job, never to fit a cap)."""
    long = [f"{m}.{name}: {n} lines" for m, p in sorted(sources().items()) for name, n in long_functions(p.read_text())]
    assert not long, "split these into steps:\n" + "\n".join(long)


def _self_names(cls: ast.ClassDef) -> set:
    """What a class defines for ``self``: its methods and class attributes, and every ``self.x`` it assigns."""
    out = set()
    for n in cls.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(n.name)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    for n in ast.walk(cls):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" \
                and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
    return out


def mixins(trees: list) -> list:
    """Package classes used as a base that read members of ``self`` which neither they nor their own bases define:
    a mixin, whose contract is whatever its host happens to have."""
    classes: dict = {}
    for t in trees:
        for n in ast.walk(t):
            if isinstance(n, ast.ClassDef):
                classes.setdefault(n.name, []).append(n)

    def defined(c: ast.ClassDef, seen=()) -> set:
        out = _self_names(c)
        for b in c.bases:
            if isinstance(b, ast.Name) and b.id in classes and b.id not in seen:
                for bc in classes[b.id]:
                    out |= defined(bc, (*seen, b.id))
        return out

    bases = {b.id for cs in classes.values() for c in cs for b in c.bases if isinstance(b, ast.Name)}
    out = []
    for name in sorted(bases & set(classes)):
        for c in classes[name]:
            reads = {n.attr for n in ast.walk(c) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                     and n.value.id == "self" and isinstance(n.ctx, ast.Load)}
            missing = reads - defined(c) - {"__class__", "__dict__"}
            if missing:
                out.append(f"{name} (reads self.{', self.'.join(sorted(missing)[:4])})")
    return out


def test_mixins_are_found():
    """The check below can fail: a base class that reads what only its subclass sets is a mixin."""
    src = "class Host(Mix):\n    def __init__(self):\n        self.x = 1\n\nclass Mix:\n    def f(self):\n        return self.x\n"
    assert mixins([ast.parse(src)]) == ["Mix (reads self.x)"]


def test_no_mixin_classes():
    """One owner per lifetime: an object's state and the methods that use it live in one class (or in a component
    it holds), not in a base class that reaches into whatever its host defines."""
    found = mixins([ast.parse(p.read_text()) for p in sources().values()])
    assert not found, "mixins: " + "; ".join(found)


ENGINE_NAMES = {"engine", "eng"}


def engine_reaches(source: str) -> list:
    """(line, what) of each parameter named ``engine``/``eng`` and each attribute read off such a name (or off
    ``self.engine``/``self.eng``) in ``source``."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            out += [(n.lineno, f"parameter {a.arg}") for a in n.args.args + n.args.kwonlyargs if a.arg in ENGINE_NAMES]
        elif isinstance(n, ast.Attribute):
            v = n.value
            if (isinstance(v, ast.Name) and v.id in ENGINE_NAMES) or (
                    isinstance(v, ast.Attribute) and v.attr in ENGINE_NAMES and isinstance(v.value, ast.Name)
                    and v.value.id == "self"):
                out.append((n.lineno, f"{ast.unparse(n)}"))
    return out


def test_engine_reaches_are_found():
    assert [w for _, w in engine_reaches("def f(eng):\n    return eng.model, self.engine.cache\n")] == [
        "parameter eng", "eng.model", "self.engine.cache"]


def test_nothing_below_the_engine_takes_the_engine():
    """Methods, draft sources, drafters (moa/ too), the round and the scheduler take a typed Target (or a narrower
    Protocol), never the engine: no parameter named engine, no attribute reach into one."""
    engine_layer = LAYERS.index(next(x for x in LAYERS if x[0] == "engine"))
    checked = [m for m in sources() if LAYER_OF[unit(m)] < engine_layer
               or unit(m) in ("swiftk.methods", "swiftk.scheduler", "swiftk.moa")]
    assert "swiftk.proposers.draft_head" in checked and "swiftk.moa.method" in checked
    bad = [f"{m}:{line}: {what}" for m in sorted(checked) for line, what in engine_reaches(sources()[m].read_text())]
    assert not bad, "\n".join(bad)


def unexplained_lazy_imports(source: str) -> list:
    """(line number, line) of each import inside a function that does not say why it is deferred: it passes when
    its own line holds a ``#`` comment, or when the line above it (above the other import lines of its block) is a
    comment. Everything else belongs at the top of the module."""
    tree = ast.parse(source)
    lines = source.splitlines()
    spans = [(n.lineno, n.end_lineno) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]

    def in_import(i: int) -> bool:   # 1-based line number
        return any(a <= i <= b for a, b in spans)

    out = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if any("#" in lines[i - 1] for i in range(node.lineno, node.end_lineno + 1)):
                continue
            above = node.lineno - 1
            while above >= 1 and in_import(above):
                above -= 1
            if above < 1 or not lines[above - 1].strip().startswith("#"):
                out.add((node.lineno, lines[node.lineno - 1].strip()))
    return sorted(out)


def test_function_level_imports_say_why():
    """An import deferred into a function costs a lookup per call and hides a dependency: it is there for a reason
    (an optional or heavy package, an import cycle, a light ``import swiftk``, a CLI subcommand), and a comment
    says which."""
    bad = [f"{p.relative_to(PKG.parent)}:{n}: {line}"
           for p in sorted(PKG.rglob("*.py")) for n, line in unexplained_lazy_imports(p.read_text())]
    assert not bad, "hoist these to the module's imports, or say why they are deferred:\n" + "\n".join(bad)


def test_bench_results_are_cited(monkeypatch):
    """bench/results keeps what the docs cite (and the summaries bench.report reads): every tracked result file's
    run is named in a tracked document or script outside bench/results, or in the run history that indexes them
    (bench/results/history.md), by its timestamp (YYYYMMDD-HHMMSS) or, as the documents often shorten it, by its time
    of day (-HHMMSS)."""
    import re
    import subprocess

    root = PKG.parent
    monkeypatch.syspath_prepend(str(root))
    from bench.report import latest_summaries

    try:
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True,
                                 check=True).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):
        import pytest
        pytest.skip("not a git checkout")
    results = [p for p in tracked if p.startswith("bench/results/")]
    text = "".join((root / p).read_text(errors="ignore") for p in tracked
                   if p.endswith((".md", ".py", ".txt")) and (root / p).is_file()
                   and (not p.startswith("bench/results/") or p == "bench/results/history.md"))
    read = {p.name for p, _ in latest_summaries(root / "bench" / "results")}

    def cited(name: str) -> bool:
        m = re.search(r"(\d{8})-(\d{4,6})", name)
        if m is None:
            return Path(name).stem in text
        return m.group(0) in text or re.search(rf"-{m.group(2)}\b", text) is not None

    stray = [p for p in results if Path(p).name not in read and not cited(Path(p).name)]
    assert not stray, f"bench/results files no document cites (cite them in docs/ or remove them): {stray}"


def test_bench_holds_runnable_benchmarks_only():
    """bench/ is what one runs (``python -m bench.NAME``, or pytest for the microbenchmarks); the code benchmarks
    share lives in benchlib/. A module in bench/ without a ``__main__`` entry is a library in the wrong place."""
    root = PKG.parent / "bench"
    libraries = [str(p.relative_to(root.parent)) for p in root.rglob("*.py")
                 if p.name not in ("__init__.py", "conftest.py") and not p.name.startswith("test_")
                 and 'if __name__ == "__main__":' not in p.read_text()]
    assert not libraries, f"library modules in bench/ (move them to benchlib/): {libraries}"
