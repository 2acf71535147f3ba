"""The logging convention, checked over the source: one logger per module, named after it; every line at
warning or above is an event (``ATE_EVENT``) an operator can filter on; docs/monitoring.md's event table lists exactly
the events the code logs."""

from __future__ import annotations

import ast
import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "ate_devplugd"
MONITORING = pathlib.Path(__file__).resolve().parents[2] / "docs" / "monitoring.md"

#: The calls on an EventLog: the event name is their first argument (after the level for ``log``).
EVENT_METHODS = {"debug", "info", "warning", "error", "log"}
#: The calls on a plain logger that need an event.
LOUD = {"warning", "error", "exception", "critical"}


def sources() -> dict[pathlib.Path, ast.Module]:
    return {
        path: ast.parse(path.read_text(), str(path)) for path in sorted(SRC.rglob("*.py")) if "_pb" not in path.parts
    }


def string_constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(node, ast.AnnAssign):
            target = node.target
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant) and isinstance(value.value, str):
            out[target.id] = value.value
    return out


def declared(tree: ast.Module) -> tuple[str, ...] | None:
    """A module whose event names are computed declares them: ``EVENTS = ("device-added", ...)``."""
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(node, ast.AnnAssign):
            target = node.target
        if isinstance(target, ast.Name) and target.id == "EVENTS":
            return tuple(ast.literal_eval(node.value))  # type: ignore[arg-type]
    return None


def is_event_log(receiver: ast.expr) -> bool:
    text = ast.unparse(receiver)
    return text.startswith("EventLog(") or re.search(r"(^|\.)_?events?$", text) is not None


def is_logger(receiver: ast.expr) -> bool:
    return re.fullmatch(r"(self\.)?_?(log|logger)|logging", ast.unparse(receiver)) is not None


def names_of(arg: ast.expr, constants: dict[str, str]) -> list[str] | None:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.Name) and arg.id in constants:
        return [constants[arg.id]]
    if isinstance(arg, ast.IfExp):
        a, b = names_of(arg.body, constants), names_of(arg.orelse, constants)
        return a + b if a is not None and b is not None else None
    return None


class Scan:
    def __init__(self) -> None:
        self.events: set[str] = set()
        self.loggers: list[str] = []
        self.silent: list[str] = []
        self.unnamed: list[str] = []
        for path, tree in sources().items():
            self.scan(path.relative_to(SRC.parent), tree)

    def scan(self, where: pathlib.Path, tree: ast.Module) -> None:
        constants = string_constants(tree)
        computed = declared(tree)
        self.events.update(computed or ())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "getLogger" and node.args:
                name = node.args[0]
                ours = isinstance(name, ast.Constant) and str(name.value).startswith("ate_devplugd")
                if ours and ast.unparse(func.value) == "logging":
                    self.loggers.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            if not isinstance(func, ast.Attribute):
                continue
            if func.attr in EVENT_METHODS and is_event_log(func.value):
                args = node.args[1:] if func.attr == "log" else node.args
                found = names_of(args[0], constants) if args else None
                if found is not None:
                    self.events.update(found)
                elif computed is None:
                    self.unnamed.append(f"{where}:{node.lineno}: {ast.unparse(node)[:100]}")
            elif func.attr in LOUD and is_logger(func.value) and not any(k.arg == "extra" for k in node.keywords):
                self.silent.append(f"{where}:{node.lineno}: {ast.unparse(node)[:100]}")


def documented_events() -> set[str]:
    """The event names in docs/monitoring.md's table of events (the section "Events")."""
    text = MONITORING.read_text()
    section = text.split("\n### Events\n", 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`([a-z0-9-]+)`", cell)}


SCAN = Scan()


def test_one_logger_per_module_named_after_it() -> None:
    assert not SCAN.loggers, "use logging.getLogger(__name__):\n" + "\n".join(SCAN.loggers)


def test_every_warning_and_error_is_an_event() -> None:
    assert not SCAN.silent, "log these through EventLog with an event name:\n" + "\n".join(SCAN.silent)


def test_every_event_name_can_be_read_from_the_code() -> None:
    assert not SCAN.unnamed, "name the event with a literal or a constant, or declare EVENTS:\n" + "\n".join(
        SCAN.unnamed
    )


def test_the_docs_list_the_events_the_code_logs() -> None:
    documented = documented_events()
    assert not SCAN.events - documented, f"not in the docs' Events table: {sorted(SCAN.events - documented)}"
    assert not documented - SCAN.events, f"in the docs' Events table, never logged: {sorted(documented - SCAN.events)}"
