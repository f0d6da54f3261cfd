"""The layout rules of the house style, checked on the source: imports flow bench → ops → workers
→ app, the emulator (a second program) sits beside workers and only ops and bench import it, no
import cycles (bench included), no view (ops/views/) importing a command, no module holding a
third of the code or over 600 lines, a docstring on each, no private name read across modules, no
function over 100 lines, an `action` on every log line at INFO and above, the ledger imported by
module, never by name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "workers", "ops", "emulator")
BENCH = "bench"  # scripts: they import each other by bare module names (bench/ is their path)
# the emulator imports app's SGLang rules (and its renderer, where it plays the server's chat
# path); the product (app, workers) never imports its own test double
LAYER = {"app": 0, "workers": 1, "emulator": 1, "ops": 2, BENCH: 3}
MAX_FUNCTION_LINES = 100


def modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Project modules imported anywhere in the file (function-level imports count too)."""
    out: set[str] = set()
    in_bench = path.relative_to(ROOT).parts[0] == BENCH
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if in_bench:  # `import common` in a bench script is bench/common.py
            names += [f"{BENCH}.{n}" for n in names if f"{BENCH}.{n.split('.')[0]}" in known]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules((*PACKAGES, BENCH))
    known = set(mods)
    return {name: imports_of(path, known) - {name} for name, path in mods.items()}


def test_imports_only_point_down_the_layers() -> None:
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in graph().items()
        for dep in deps
        if LAYER[dep.split(".")[0]] > LAYER[mod.split(".")[0]]
    ]
    assert wrong == []


# app's parts, lowest first: a part imports only parts below it (two parts on one level are
# strangers); the package's __init__ and the Celery app sit on top
APP_PARTS = {
    "app.core": 0,
    "app.storage": 1,
    "app.sglang": 1,
    "app.ledger": 2,
    "app.prompts": 3,
    "app.outputs": 4,
    "app.celery_app": 5,
    "app": 6,
}


def part_of(module: str, parts: dict[str, int]) -> str:
    """The part of a package (`app.ledger`, `workers.engine`) module belongs to."""
    package, _, _ = module.partition(".")
    part = ".".join(module.split(".")[:2])
    return part if part in parts else package


def app_part(module: str) -> str:
    return part_of(module, APP_PARTS)


def upward_imports(package: str, parts: dict[str, int]) -> list[str]:
    """Imports inside package from a part to a part on its level or above."""
    return [
        f"{mod} imports {dep}"
        for mod, deps in graph().items()
        if mod.split(".")[0] == package
        for dep in deps
        # `from app import ledger` names the package too: only its parts count
        if dep.split(".")[0] == package
        and dep != package
        and part_of(dep, parts) != part_of(mod, parts)
        and parts[part_of(dep, parts)] >= parts[part_of(mod, parts)]
    ]


def test_app_parts_import_only_parts_below_them() -> None:
    assert upward_imports("app", APP_PARTS) == []


def test_the_app_layering_check_sees_a_part_import_upward() -> None:
    """Guards the check above against passing vacuously (every module mapped to one part)."""
    assert app_part("app.ledger.reads") == "app.ledger"
    assert app_part("app.celery_app") == "app.celery_app"
    assert "app.storage.shards" in graph()["app.ledger.reads"]


# workers' parts, lowest first: a part imports only parts below it; the engine drives the
# others (it may import control, chains and intake), control may import chains and intake,
# chains intake; the package and its Celery tasks sit on top
WORKER_PARTS = {
    "workers.intake": 0,
    "workers.chains": 1,
    "workers.control": 2,
    "workers.engine": 3,
    "workers.tasks": 4,
    "workers": 5,
}


def test_workers_parts_import_only_parts_below_them() -> None:
    assert upward_imports("workers", WORKER_PARTS) == []


def test_the_workers_layering_check_sees_the_parts_meet() -> None:
    """Guards the check above against passing vacuously: the engine imports control."""
    assert part_of("workers.engine.probes", WORKER_PARTS) == "workers.engine"
    assert part_of("workers.tasks", WORKER_PARTS) == "workers.tasks"
    assert "workers.control.health" in graph()["workers.engine.probes"]


def is_command(module: str) -> bool:
    return module.startswith("ops.") and module.count(".") == 1 and module.endswith("_cmd")


def test_views_never_import_a_command() -> None:
    """ops/views/ draws what commands read; what a view and a command share lives below both
    (a read model in app/ledger), never in a command a view imports."""
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in graph().items()
        if mod.startswith("ops.views.")
        for dep in deps
        if is_command(dep)
    ]
    assert wrong == []
    assert is_command("ops.fleet_cmd") and not is_command("ops.views.dashboard")


def test_the_product_and_the_emulator_meet_only_in_app() -> None:
    """The product never imports its test double; the emulator takes nothing but app."""
    sides = {"workers": "emulator", "emulator": "workers"}
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in graph().items()
        for dep in deps
        if sides.get(mod.split(".")[0]) == dep.split(".")[0]
    ]
    assert wrong == []


def test_no_import_cycles() -> None:
    g = graph()
    # a package's __init__ importing its own submodules is not a cycle of logic
    for mod in g:
        g[mod] = {
            d
            for d in g[mod]
            if not (d.startswith(mod + ".") and (ROOT / mod.replace(".", "/")).is_dir())
        }
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(g[node]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_no_module_holds_a_third_of_the_code() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    total = sum(sizes.values())
    assert max(sizes.values()) < total / 3, max(sizes.items(), key=lambda kv: kv[1])


# a module past this many lines holds more than one concern (style.md: split by what the parts
# serve); bench's scripts count too
MAX_MODULE_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    sizes = {
        name: len(path.read_text().splitlines())
        for name, path in modules((*PACKAGES, BENCH)).items()
    }
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_every_module_opens_with_a_docstring() -> None:
    missing = [
        name
        for name, path in modules().items()
        if path.read_text().strip() and ast.get_docstring(ast.parse(path.read_text())) is None
    ]
    assert missing == []


def test_only_settings_reads_the_environment() -> None:
    readers = [
        name
        for name, path in modules().items()
        if name != "app.core.settings"
        and ("os.environ" in path.read_text() or "os.getenv" in path.read_text())
    ]
    assert readers == []


def exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in the product and the emulator, imported."""
    import importlib

    found: list[type[BaseException]] = []
    for name, path in modules().items():
        defined = {
            node.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)
        }
        if not defined:
            continue
        module = importlib.import_module(name)
        for cls_name in sorted(defined):
            cls = getattr(module, cls_name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append(cls)
    return found


def test_every_exception_has_the_one_root() -> None:
    """`except TokenmillError` catches every error of tokenmill (style.md, rule 5)."""
    from app.core.errors import TokenmillError

    classes = exception_classes()
    assert len(classes) > 20  # the walk found the tree, not nothing
    wrong = [
        f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, TokenmillError)
    ]
    assert wrong == []


def string_constants(path: Path, prefixes: tuple[str, ...]) -> dict[str, str]:
    """Module-level NAME = "text" (or NAME: Final = "text") whose name starts with a prefix."""
    found: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if (
            isinstance(target, ast.Name)
            and target.id.startswith(prefixes)
            and isinstance(value, ast.Constant)
            and isinstance(value.value, str)
        ):
            found[target.id] = value.value
    return found


def test_event_kinds_and_pause_reasons_live_in_constants() -> None:
    """Every event kind and pause reason is one constant of app.core.constants, and the Literal
    types that record_event and the pause calls take list exactly those."""
    from typing import get_args

    from app.core import constants

    prefixes = ("EVENT_", "PAUSED_BY_")
    elsewhere = [
        f"{name}.{constant}"
        for name, path in modules().items()
        if name != "app.core.constants"
        for constant in string_constants(path, prefixes)
    ]
    assert elsewhere == []
    own = string_constants(ROOT / "app/core/constants.py", prefixes)
    events = {v for k, v in own.items() if k.startswith("EVENT_")}
    reasons = {v for k, v in own.items() if k.startswith("PAUSED_BY_")}
    assert len(events) == len([k for k in own if k.startswith("EVENT_")]), "two kinds, one text"
    assert set(get_args(constants.EventKind)) == events
    assert set(get_args(constants.PauseReason)) == reasons


def test_no_package_re_exports_names() -> None:
    """A package's __init__ is its docstring: callers import the module that owns a name (a
    façade is one more way to reach it). `app` alone resolves `celery -A app`'s app lazily."""
    wrong = []
    for name, path in modules().items():
        if path.name != "__init__.py" or name == "app":
            continue
        body = ast.parse(path.read_text()).body
        if any(isinstance(node, ast.Import | ast.ImportFrom) for node in body):
            wrong.append(name)
    assert wrong == []


LEDGER = "app.ledger"
# every folder of Python in the repository: the product, its commands, the emulator, bench, the
# tests and the migrations
LEDGER_IMPORTERS = ("app", "workers", "ops", "emulator", "bench", "tests", "migrations")


def ledger_names_imported(source: str, package: str) -> list[str]:
    """Imports that take a name out of a ledger module (`from app.ledger.claims import
    claim_items`, relative ones inside the package, `import app.ledger.claims`) at any depth:
    the ledger is imported by module (`from app.ledger import claims`, then
    `claims.claim_items(...)`), so where a name lives is in the code that uses it. `package` is
    the dotted package of the file, to resolve relative imports."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = node.module
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module])
            if module.startswith(LEDGER + "."):
                found += [f"{node.lineno}: from {module} import {a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.startswith(LEDGER + ".")
            ]
    return found


def test_the_ledger_is_imported_by_module() -> None:
    """House style: import modules, not names, where a name's home matters to the reader."""
    wrong = []
    for folder in LEDGER_IMPORTERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            package = ".".join(path.relative_to(ROOT).parent.parts)
            wrong += [
                f"{path.relative_to(ROOT)}:{found}"
                for found in ledger_names_imported(path.read_text(), package)
            ]
    assert wrong == []


def test_the_ledger_import_check_sees_names_taken_from_a_module() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from app.ledger import claims, outcomes\n"
        "from app.ledger.reads import (\n"
        "    RunCounts,\n"
        "    run_counts as counts,\n"
        ")\n"
        "import app.ledger.counters as counters\n"
        "from app.ledgerish import name\n"
        "from .claims import claim_items\n"
        "from . import queue\n"
        "if TYPE_CHECKING:\n"
        "    from app.ledger.run_queries import RunInfo\n"
        "def f() -> None:\n"
        "    from app.ledger.common import utcnow\n"
    )
    assert ledger_names_imported(source, "app.ledger") == [
        "3: from app.ledger.reads import RunCounts",
        "3: from app.ledger.reads import run_counts",
        "7: import app.ledger.counters",
        "9: from app.ledger.claims import claim_items",
        "12: from app.ledger.run_queries import RunInfo",
        "14: from app.ledger.common import utcnow",
    ]
    assert ledger_names_imported(source, "ops") == [
        "3: from app.ledger.reads import RunCounts",
        "3: from app.ledger.reads import run_counts",
        "7: import app.ledger.counters",
        "12: from app.ledger.run_queries import RunInfo",
        "14: from app.ledger.common import utcnow",
    ]


LOGGED_LEVELS = {"info", "warning", "error", "exception", "critical"}


def log_lines_without_action(source: str) -> list[int]:
    """Lines of logger calls at INFO and above whose `extra` names no `action`: a dict with an
    "action" key, or a call given action= (workers' item_fields)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in LOGGED_LEVELS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in {"log", "logger"}
        ):
            continue
        extra = next((k.value for k in node.keywords if k.arg == "extra"), None)
        named = (
            isinstance(extra, ast.Dict)
            and any(isinstance(k, ast.Constant) and k.value == "action" for k in extra.keys)
        ) or (isinstance(extra, ast.Call) and any(k.arg == "action" for k in extra.keywords))
        if not named:
            lines.append(node.lineno)
    return lines


def test_every_log_line_at_info_and_above_names_its_action() -> None:
    """A state change logged by the product carries `action` in `extra` (a field of each JSON
    line, what a log query selects on); DEBUG lines are the only ones free of it."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line}"
        for name, path in modules(("app", "workers", "ops")).items()
        for line in log_lines_without_action(path.read_text())
    ]
    assert wrong == []


def test_the_action_check_sees_a_line_without_one() -> None:
    source = (
        'log.info("a", extra={"action": "done"})\n'
        "log.warning('b %s', x)\n"
        'log.info("c", extra=item_fields(item, s, action="failed"))\n'
        'log.error("d", extra={"run_id": 1})\n'
        'log.debug("e")\n'
    )
    assert log_lines_without_action(source) == [2, 4]


def test_the_graph_sees_bench_scripts_import_each_other() -> None:
    """The bench/ rules above would pass vacuously if its bare imports were not resolved."""
    assert "bench.common" in graph()["bench.scale"]


# a named tuple's public methods start with "_" so as not to clash with its fields
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})


def private(name: str) -> bool:
    if name in NAMEDTUPLE_API:
        return False
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions and classes, and its attributes
    (self._x / cls._x)."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            own.add(node.attr)
    return {name for name in own if private(name)}


def private_reads(path: Path) -> list[str]:
    """Private names this module takes from another: imported by name, or read as an
    attribute of anything but self/cls that this module does not define itself."""
    tree = ast.parse(path.read_text())
    own = own_private_names(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.Attribute) and private(node.attr):
            receiver = node.value
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                continue
            if node.attr not in own:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_private_name_is_read_across_modules_in_workers() -> None:
    wrong = [
        f"{name}:{read}"
        for name, path in modules(("workers",)).items()
        for read in private_reads(path)
    ]
    assert wrong == []


def test_the_private_read_check_sees_a_reach_into_another_object(tmp_path: Path) -> None:
    path = tmp_path / "reach.py"
    path.write_text(
        "from m import _helper\n"
        "class A:\n"
        "    def __init__(self) -> None:\n"
        "        self._mine = 1\n"
        "    def f(self, other: A, w: object) -> object:\n"
        "        return self._mine + other._mine + w._cond + w.__class__\n"
    )
    assert private_reads(path) == ["1: import _helper", "6: w._cond"]


def test_no_protocol_lists_private_attributes() -> None:
    """A Protocol is an interface between modules: what it lists is public."""
    wrong: list[str] = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
            if "Protocol" not in bases:
                continue
            for member in node.body:
                target = (
                    member.target.id
                    if isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name)
                    else getattr(member, "name", "")
                )
                if private(target):
                    wrong.append(f"{name}.{node.name}.{target}")
    assert wrong == []


def test_no_function_in_workers_or_app_is_over_100_lines() -> None:
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, path in modules(("app", "workers")).items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_window_takes_few_parameters_and_owns_its_room() -> None:
    """InflightWindow asks one RunPolicy about its runs (no bag of callables), and only the
    window's own modules touch its room: the Celery push and the embedded pull use admit()."""
    import inspect

    from workers.engine.window import InflightWindow

    params = [p for p in inspect.signature(InflightWindow.__init__).parameters if p != "self"]
    assert len(params) <= 6, params
    wrong = [
        str(path.relative_to(ROOT))
        for name, path in modules(("workers", "ops", "app")).items()
        if not path.name.startswith("window")
        and any(
            isinstance(node, ast.Attribute) and node.attr in {"_reserve", "_unreserve", "_room"}
            for node in ast.walk(ast.parse(path.read_text()))
        )
    ]
    assert wrong == []


def window_like(node: ast.expr, aliases: set[str]) -> bool:
    """Whether node names a window: `window`, `rt.window`, `self._window`, or an alias of one."""
    if isinstance(node, ast.Name):
        return "window" in node.id.lower() or node.id in aliases
    return isinstance(node, ast.Attribute) and "window" in node.attr.lower()


def window_writes(source: str) -> list[str]:
    """`<a window>.<attr> = ...` (plain, augmented or annotated), aliases (`w = self._window`)
    followed."""
    tree = ast.parse(source)
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and window_like(node.value, aliases):
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    wrong = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [
                e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])
            ]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        wrong += [
            f"line {t.lineno}: .{t.attr}"
            for t in targets
            if isinstance(t, ast.Attribute) and window_like(t.value, aliases)
        ]
    return wrong


def test_no_module_outside_the_window_writes_its_fields() -> None:
    """The window's state changes through its methods only (and the server's state through
    ServerState's): no `rt.window.down = ...` from another module."""
    own = ROOT / "workers" / "engine" / "window.py"
    wrong = [
        f"{path.relative_to(ROOT)} {write}"
        for path in modules((*PACKAGES, BENCH)).values()
        if path != own
        for write in window_writes(path.read_text())
    ]
    assert wrong == []


def test_the_window_write_check_sees_writes_and_aliases() -> None:
    source = (
        "def f(rt, self):\n"
        "    rt.window.down = 'x'\n"
        "    w = self._window\n"
        "    w.auth_error = None\n"
        "    window.stats.done += 1\n"
        "    self._window = rt.window\n"
    )
    assert window_writes(source) == ["line 2: .down", "line 4: .auth_error"]
