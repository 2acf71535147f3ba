"""The package's shape: its import graph runs one way, down the layers, with no circle; no module is big.

Every import counts, lazy ones inside functions and ``if TYPE_CHECKING:`` ones included: a circle that is
only type-only still means two modules that cannot be read, changed or tested apart. The layers are the
ones README's code map draws; a new module is placed in one here, or this test fails.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
PACKAGE = "ate_devplugd"

#: Lowest first. A module may import modules of its own layer or of lower ones, never of a higher one.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    (
        "foundations: no knowledge of devices, kubelet or config",
        frozenset(
            {
                "ate_devplugd",
                "ate_devplugd.dra",
                "ate_devplugd.atomicfile",
                "ate_devplugd.backoff",
                "ate_devplugd.findings",
                "ate_devplugd.grpc_compat",
                "ate_devplugd.inotify",
                "ate_devplugd.kernel",
                "ate_devplugd.kvm_events",
                "ate_devplugd.logs",
                "ate_devplugd.malloc",
                "ate_devplugd.notify",
                "ate_devplugd.promtext",
                "ate_devplugd.reload_result",
                "ate_devplugd.unixsock",
                "ate_devplugd.unixserver",
            }
        ),
    ),
    (
        "the configuration and the facts it is checked against",
        frozenset(
            {
                "ate_devplugd.device_config",
                "ate_devplugd.dra.config",
                "ate_devplugd.dra.pools",
                "ate_devplugd.dra.kubeconfig",
                "ate_devplugd.config",
                "ate_devplugd.runtime_facts",
                "ate_devplugd.cdi_rules",
                "ate_devplugd.runtime_endpoint",
                "ate_devplugd.remedies",
                "ate_devplugd.toml_text",
            }
        ),
    ),
    (
        "the node's parts, each followed or served on its own",
        frozenset(
            {
                "ate_devplugd.devices",
                "ate_devplugd.device_watch",
                "ate_devplugd.cdi",
                "ate_devplugd.cdi_conflicts",
                "ate_devplugd.servicer",
                "ate_devplugd.endpoint",
                "ate_devplugd.lock",
                "ate_devplugd.kubelet_watch",
                "ate_devplugd.podresources",
                "ate_devplugd.runtime_ask",
                "ate_devplugd.textfile",
                "ate_devplugd.runtime_files",
                "ate_devplugd.udev",
                "ate_devplugd.metrics",
                "ate_devplugd.dra.apiclient",
                "ate_devplugd.dra.node",
                "ate_devplugd.dra.credentials",
                "ate_devplugd.dra.metrics",
                "ate_devplugd.dra.presence",
                "ate_devplugd.dra.slice_plan",
                "ate_devplugd.dra.slice_log",
                "ate_devplugd.dra.layout",
                "ate_devplugd.dra.reconnect",
            }
        ),
    ),
    (
        "what follows them: a resource's session, the runtime check, a driver's services",
        frozenset(
            {
                "ate_devplugd.session",
                "ate_devplugd.plugins",
                "ate_devplugd.runtime_cdi",
                "ate_devplugd.dra.prepare",
                "ate_devplugd.dra.slices",
                "ate_devplugd.dra.service",
            }
        ),
    ),
    (
        "the modes",
        frozenset({"ate_devplugd.dra.driver", "ate_devplugd.dra.mode"}),
    ),
    (
        "what a command runs",
        frozenset(
            {
                "ate_devplugd.daemon",
                "ate_devplugd.reload_decision",
                "ate_devplugd.reload_report",
                "ate_devplugd.reload_request",
                "ate_devplugd.nodeprobe",
                "ate_devplugd.doctor",
                "ate_devplugd.doctor_daemon",
                "ate_devplugd.doctor_runtime",
                "ate_devplugd.dra.doctor",
                "ate_devplugd.dra.probe",
                "ate_devplugd.dra.manifests",
            }
        ),
    ),
    ("the command line", frozenset({"ate_devplugd.cli", "ate_devplugd.cli_args", "ate_devplugd.__main__"})),
)
#: The layer from which a module may use both modes' own modules (the commands).
COMMANDS = 5

#: Modules that only device-plugin mode uses. Below the commands, only they import each other: what both
#: modes share (the lock, the metrics, a back-off) lives below them.
DEVICE_PLUGIN_ONLY = frozenset(
    {
        "ate_devplugd.endpoint",
        "ate_devplugd.servicer",
        "ate_devplugd.session",
        "ate_devplugd.plugins",
        "ate_devplugd.nodeprobe",
    }
)
#: The modules of the dra package that only DRA mode uses (its config and pools are parsed by config.py).
DRA_SHARED = frozenset(
    {"ate_devplugd.dra", "ate_devplugd.dra.config", "ate_devplugd.dra.pools", "ate_devplugd.dra.kubeconfig"}
)


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


def layer_of() -> dict[str, int]:
    return {mod: i for i, (_, mods) in enumerate(LAYERS) for mod in mods}


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def readme_layers() -> dict[str, int]:
    """README's code map: each module row under the heading of its layer (``**N. ...**``)."""
    text = (SRC.parent / "README.md").read_text()
    section = text.split("\n### Code map\n", 1)[1].split("\n## ", 1)[0]
    found: dict[str, int] = {}
    layer = -1
    for line in section.splitlines():
        if heading := re.match(r"\*\*(\d+)\. ", line):
            layer = int(heading[1])
        elif row := re.match(r"\| `([\w/]+)\.py` \|", line):
            found[PACKAGE + "." + row[1].replace("/", ".")] = layer
    return found


def test_readme_code_map_shows_the_layers() -> None:
    """Every module has its row in README's code map, under its layer's heading."""
    wanted = {mod: i for mod, i in layer_of().items() if mod not in (PACKAGE, f"{PACKAGE}.dra")}
    assert readme_layers() == wanted


def test_every_module_has_a_layer() -> None:
    missing = sorted(set(modules()) - set(layer_of()))
    assert not missing, f"place these in LAYERS: {missing}"


def test_no_import_runs_up_the_layers() -> None:
    layers = layer_of()
    up = sorted(
        f"{src} ({LAYERS[layers[src]][0]}) -> {dst} ({LAYERS[layers[dst]][0]})"
        for src, dsts in graph().items()
        for dst in dsts
        if src in layers and dst in layers and layers[dst] > layers[src]
    )
    assert not up, "imports that run up the layers:\n" + "\n".join(up)


def own_mode(name: str) -> str | None:
    if name in DEVICE_PLUGIN_ONLY:
        return "device-plugin"
    if name.startswith("ate_devplugd.dra.") and name not in DRA_SHARED:
        return "dra"
    return None


def crosses(src: str, dst: str, layers: dict[str, int]) -> bool:
    """A mode's own module imported by the other mode's, or by a shared module below the commands."""
    theirs, mine = own_mode(dst), own_mode(src)
    if theirs is None or theirs == mine:
        return False
    return mine is not None or layers.get(src, COMMANDS) < COMMANDS


def test_a_mode_uses_only_its_own_and_shared_modules() -> None:
    layers = layer_of()
    crossing = sorted(
        f"{src} -> {dst} ({own_mode(dst)} mode only)"
        for src, dsts in graph().items()
        for dst in dsts
        if crosses(src, dst, layers)
    )
    assert not crossing, "imports of the other mode's modules, or of a mode's from shared ones:\n" + "\n".join(crossing)


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
