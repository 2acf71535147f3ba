"""The package's shape: its import graph runs one way, down the layers, with no circle; no module is big.

Every import counts, lazy ones inside functions and ``if TYPE_CHECKING:`` ones included: a circle that is
only type-only still means two modules that cannot be read, changed or tested apart. The layers are the
ones docs/code-map.md draws; a new module is placed in one here, or this test fails.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
PACKAGE = "ate_devplugd"

#: The packages, lowest first. A module may import its own package's modules and those of lower packages, never
#: those of a higher one. The two modes (device-plugin and DRA) share a rank and never import each other.
PACKAGES: tuple[tuple[str, str], ...] = (
    ("base", "foundations: no knowledge of devices, kubelet or config"),
    ("config", "the configuration, validated field by field"),
    ("node", "the node's devices, udev, KVM's announcements, our CDI spec"),
    ("kubelet", "kubelet's plugin directory, which kubelet is there, its pod-resources API"),
    ("cri", "the container runtime kubelet uses, and what it does with our CDI names"),
    ("signals", "sd_notify, the metrics and their file"),
    ("deviceplugin", "device-plugin mode"),
    ("dra", "DRA mode"),
    ("reload", "reloads, and the record the running daemon keeps of itself"),
    ("daemon", "the daemon: the parts wired together on one loop"),
    ("commands", "the command line, and what the other commands run"),
)
#: The modes: same rank, apart from each other; only the daemon, the commands and the command line import them.
MODES = frozenset({"deviceplugin", "dra"})
#: What may stand at the top of the package (the version, ``python -m`` and the command line).
TOP = frozenset({"ate_devplugd", "ate_devplugd.__main__", "ate_devplugd.cli"})


def rank(package: str) -> int:
    """A package's layer; the two modes share one."""
    names = [name for name, _ in PACKAGES]
    index = names.index(package)
    return index - 1 if package == "dra" else index


#: Lines a module may have: a module this long does more than one job.
MAX_LINES = 350
#: The daemon only wires the parts together.
MAX_LINES_OF = {"ate_devplugd.daemon": 300}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if "_pb" in parts:
            continue  # generated code
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def test_no_module_is_big() -> None:
    big = sorted(
        f"{name}: {lines} lines (at most {limit})"
        for name, path in modules().items()
        if (lines := len(path.read_text().splitlines())) > (limit := MAX_LINES_OF.get(name, MAX_LINES))
    )
    assert not big, "modules over their size budget:\n" + "\n".join(big)


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Every module of ours that ``name`` imports, anywhere in the file."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif base in known:
                    out.add(base)
    out.discard(name)
    return out


def package_of(name: str) -> str | None:
    """The package a module belongs to (``ate_devplugd.node.udev`` -> ``node``); None at the top."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and name not in TOP else None


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def test_every_module_is_in_a_package_of_its_layer() -> None:
    """Nothing but the version, ``__main__`` and ``cli`` at the top; every package has its layer."""
    known = {name for name, _ in PACKAGES}
    placed_nowhere = sorted(
        name for name in modules() if name not in TOP and (package_of(name) not in known or name.count(".") < 1)
    )
    assert not placed_nowhere, f"modules in no package of PACKAGES: {placed_nowhere}"


def test_every_package_is_in_the_tree() -> None:
    assert {name for name, _ in PACKAGES} == {path.name for path in (SRC / PACKAGE).iterdir() if path.is_dir()} - {
        "_pb",
        "__pycache__",
    }


def test_no_import_runs_up_the_layers() -> None:
    up = sorted(
        f"{src} -> {dst}"
        for src, dsts in graph().items()
        for dst in dsts
        if (a := package_of(src)) and (b := package_of(dst)) and a != b and rank(b) >= rank(a)
    )
    assert not up, "imports that run up the layers (or between the modes):\n" + "\n".join(up)


def test_only_the_daemon_and_the_commands_use_a_mode() -> None:
    outside = sorted(
        f"{src} -> {dst}"
        for src, dsts in graph().items()
        for dst in dsts
        if package_of(dst) in MODES and package_of(src) not in (MODES | {"daemon", "commands", None})
    )
    assert not outside, "a mode's modules imported from below the daemon:\n" + "\n".join(outside)


def package_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for src, dsts in graph().items():
        a = package_of(src) or src
        edges.setdefault(a, set()).update(b for d in dsts if (b := package_of(d) or d) != a)
    return edges


def test_no_circle_between_packages() -> None:
    found = circles(package_graph())
    assert not found, "package circles: " + "; ".join(" <-> ".join(c) for c in found)


CODE_MAP = SRC.parent / "docs" / "code-map.md"


def code_map() -> dict[str, str]:
    """docs/code-map.md: each module's row (``| `node/udev.py` | ...``) under its package's heading."""
    found: dict[str, str] = {}
    heading = ""
    for line in CODE_MAP.read_text().splitlines():
        if match := re.match(r"## `(\w+)/`", line):
            heading = match[1]
        elif row := re.match(r"\| `([\w/]+)\.py` \|", line):
            name = ".".join([PACKAGE, *row[1].split("/")]).removesuffix(".__init__")
            found[name] = heading if package_of(name) else ""
    return found


def test_code_map_follows_the_tree() -> None:
    """Every module has one row in docs/code-map.md, under its package's heading; none that is gone."""
    wanted = {name: package_of(name) or "" for name in modules()}
    assert code_map() == wanted


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle() -> None:
    found = circles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_circles_are_found(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert sorted(circles(edges)) == expected


def test_lazy_and_type_only_imports_count(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ate_devplugd.b import X\n"
        "def f():\n    from ate_devplugd import c\n    from . import d\n"
    )
    known = {"ate_devplugd.b", "ate_devplugd.c", "ate_devplugd.d"}
    assert imports("ate_devplugd.m", path, known) == known
