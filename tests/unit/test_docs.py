"""README.md is a front door and docs/ holds the rest: README stays short with Install near its top, every
section the long README had is still a heading somewhere, every block a reader would paste parses (shell with
``bash -n`` and ate-devplugd's own argument parser, TOML with tomllib and the config loader, YAML, unit files,
Python), and every link between the files points at a file and a heading that exist."""

import argparse
import ast
import configparser
import contextlib
import io
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import tomllib
from dataclasses import dataclass

import pytest
import yaml

from ate_devplugd import config
from ate_devplugd.commands import args as cli_args

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").glob("*.md")])

README_MAX_BYTES = 25 * 1024
INSTALL_WITHIN_LINES = 100

#: The headings of README.md before it became a front door (main e63775c), frozen: each must stay a heading
#: of README.md or of a file in docs/, under this name or the one RENAMED gives it.
FORMER_HEADINGS = (
    "ate-devplugd",
    "Requesting the device from a pod",
    "Non-root sandboxes",
    "What was proven where",
    "DRA mode",
    "The device layout",
    "Credentials for DRA mode",
    "A node-bound token for a host service",
    "Configuration",
    "Command line",
    "Installing",
    "Upgrading in place",
    "Proven on cgroup v2, and across restarts",
    "Operating it",
    "Events",
    "`ate-devplugd doctor`",
    "Monitoring",
    "How it behaves toward kubelet",
    "Development",
    "Code map",
    "Performance",
)
RENAMED = {
    "Installing": "Install",
    "Operating it": "Operating ate-devplugd",
}

#: Files that other work adds beside this one: a link to one of them is let through while it is absent.
PLANNED = {"docs/usable.md", "docs/self-healing.md", "docs/switching.md"}

#: What each block's tag means. Every block says what it is; ``text`` (output, a transcript, a synopsis) and
#: ``promql`` are read, not pasted.
SHELL, SKIPPED = {"sh", "bash"}, {"text", "promql"}
KNOWN = SHELL | SKIPPED | {"toml", "yaml", "ini", "python"}


@dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int
    lang: str
    text: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.lang or 'no tag'})"


def blocks(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of a Markdown file, indented ones (in a list item) included, their indent removed."""
    found: list[Block] = []
    opened: tuple[int, str, int] | None = None
    body: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"( *)```(\S*)\s*$", line)
        if fence and opened is None:
            opened, body = (number, fence.group(2), len(fence.group(1))), []
        elif fence and opened is not None:
            found.append(Block(path, opened[0], opened[1], "\n".join(body) + "\n"))
            opened = None
        elif opened is not None:
            body.append(line[opened[2] :] if line[: opened[2]].strip() == "" else line)
    assert opened is None, f"{path.relative_to(ROOT)}:{opened[0]}: a block that is never closed"
    return found


def headings(path: pathlib.Path) -> list[str]:
    """The Markdown headings of a file (outside its blocks), without their #s."""
    inside, found = False, []
    for line in path.read_text().splitlines():
        if re.match(r" *```", line):
            inside = not inside
        elif not inside and (m := re.match(r"#{1,6} (.+?)\s*$", line)):
            found.append(m.group(1))
    return found


def anchor(heading: str) -> str:
    """The id GitHub gives a heading: lowercase, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


ALL_BLOCKS = [block for path in DOCS for block in blocks(path)]


def of(*langs: str) -> list[Block]:
    return [block for block in ALL_BLOCKS if block.lang in langs]


def test_readme_is_a_front_door() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, more than {README_MAX_BYTES}: move detail to docs/"
    top = README.read_text().splitlines()[:INSTALL_WITHIN_LINES]
    assert any(re.match(r"#{1,6} .*Install", line) for line in top), "no Install heading in README's first 100 lines"


def test_every_former_readme_section_is_still_a_heading() -> None:
    present = {heading for path in DOCS for heading in headings(path)}
    missing = [name for name in FORMER_HEADINGS if RENAMED.get(name, name) not in present]
    assert not missing, f"former README sections that are no heading in README.md or docs/: {missing}"


def test_every_block_says_what_it_is() -> None:
    unknown = [f"{block}" for block in ALL_BLOCKS if block.lang not in KNOWN]
    assert not unknown, f"tag each block ({', '.join(sorted(KNOWN))}): {unknown}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("block", of(*SHELL), ids=str)
def test_shell_blocks_parse(block: Block) -> None:
    text = re.sub(r"(?m)^\$ ", "", block.text)
    done = subprocess.run(["bash", "-n"], check=False, input=text, capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, f"{block}: bash -n: {done.stderr}"


def commands(text: str) -> list[list[str]]:
    """Each simple command of a shell text (split at |, &&, ||, ; and newlines; comments dropped)."""
    found: list[list[str]] = []
    for line in text.replace("\\\n", " ").splitlines():  # a comment runs to the end of its line only
        current: list[str] = []
        for token in shlex.shlex(line, posix=True, punctuation_chars=";&|"):
            if set(token) <= set(";&|"):
                found.append(current)
                current = []
            else:
                current.append(token)
        found.append(current)
    return [command for command in found if command]


ATE_COMMANDS = [
    (block, command[1:])
    for block in of(*SHELL)
    for command in commands(re.sub(r"(?m)^\$ ", "", block.text))
    if command[0] == "ate-devplugd"
]


def test_the_docs_show_ate_devplugd_commands() -> None:
    assert len(ATE_COMMANDS) >= 5, ATE_COMMANDS


@pytest.mark.parametrize(("block", "argv"), ATE_COMMANDS, ids=lambda x: str(x) if isinstance(x, Block) else " ".join(x))
def test_ate_devplugd_command_lines_parse(block: Block, argv: list[str]) -> None:
    parser = cli_args.build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = parser.parse_args(cli_args.command_first(parser, argv))
    except SystemExit as exc:
        pytest.fail(f"{block}: ate-devplugd {' '.join(argv)}: exit {exc.code}: {err.getvalue().strip()}")
    assert isinstance(parsed, argparse.Namespace)


def is_whole_config(data: dict[str, object]) -> bool:
    return "device" in data or "mode" in data


@pytest.mark.parametrize("block", of("toml"), ids=str)
def test_toml_blocks_parse_and_whole_configs_load(block: Block) -> None:
    try:
        data = tomllib.loads(block.text)
    except tomllib.TOMLDecodeError as exc:
        pytest.fail(f"{block}: not TOML: {exc}")
    if is_whole_config(data):
        try:  # a group name in a config is the host's: any gid will do here
            config.parse(block.text, source=str(block), gid_of=lambda name: 108)
        except config.ConfigError as exc:
            pytest.fail(f"{block}: the config loader refuses it: {exc}")


def test_some_toml_block_is_a_whole_config() -> None:
    assert any(is_whole_config(tomllib.loads(block.text)) for block in of("toml"))


@pytest.mark.parametrize("block", of("yaml"), ids=str)
def test_yaml_blocks_parse(block: Block) -> None:
    documents = list(yaml.safe_load_all(block.text))
    assert all(isinstance(document, dict) for document in documents), f"{block}: {documents!r}"


@pytest.mark.parametrize("block", of("ini"), ids=str)
def test_unit_file_blocks_parse(block: Block) -> None:
    # one block may show two files (a service and its timer), so a section may come twice
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    parser.read_string(block.text, source=str(block))
    assert parser.sections(), block


@pytest.mark.parametrize("block", of("python"), ids=str)
def test_python_blocks_compile(block: Block) -> None:
    compile(block.text, str(block), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT | ast.PyCF_ONLY_AST)


def links(path: pathlib.Path) -> list[tuple[int, str]]:
    """The Markdown links of a file outside its blocks, with their line numbers."""
    inside, found = False, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if re.match(r" *```", line):
            inside = not inside
        elif not inside:
            # the target of [text](target); inline code is not a link
            found += [(number, m) for m in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line))]
    return found


def test_internal_links_point_at_files_and_headings_that_exist() -> None:
    broken = []
    for path in DOCS:
        for number, target in links(path):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:: not ours to check
            file, _, fragment = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not linked.exists():
                if linked.relative_to(ROOT).as_posix() not in PLANNED:
                    broken.append(f"{where}: no such file")
                continue
            if fragment and linked.suffix == ".md" and fragment not in {anchor(h) for h in headings(linked)}:
                broken.append(f"{where}: no such heading")
    assert not broken, "\n".join(broken)


def test_anchor_is_githubs() -> None:
    assert anchor("`ate-devplugd doctor`") == "ate-devplugd-doctor"
    assert anchor("The unit's drop-in, and reload") == "the-units-drop-in-and-reload"
    assert anchor("Proven on cgroup v2, and across restarts") == "proven-on-cgroup-v2-and-across-restarts"


#: Where a file a doc names may be: the checkout, the package, the suites.
MODULE_ROOTS = (ROOT, ROOT / "src" / "ate_devplugd", ROOT / "tests", ROOT / "bench")
#: Every file of the checkout the docs may name by its base name alone.
TREE_NAMES = {path.name for top in ("src", "tests", "bench", "packaging") for path in (ROOT / top).rglob("*.py")}


def named_modules(text: str) -> set[str]:
    """The Python files a text names in code spans (``cri/usable.py``, ``fault/test_x.py::test_y``)."""
    return {m.split("::")[0] for m in re.findall(r"`+([A-Za-z0-9_./-]+\.py(?:::[^`\s]*)?)`+", text)}


def test_every_module_a_doc_names_exists() -> None:
    """A module or test file named in README, docs/, the man pages or a docstring of ours is in the tree."""
    sources = [*DOCS, *(ROOT / "packaging" / "man").iterdir(), *(ROOT / "src" / "ate_devplugd").rglob("*.py")]
    missing = []
    for path in sources:
        for name in sorted(named_modules(path.read_text())):
            found = name in TREE_NAMES if "/" not in name else any((top / name).exists() for top in MODULE_ROOTS)
            if not found:
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "files named that do not exist:\n" + "\n".join(missing)


#: Names of documents that are not in the repository (a reader of the project cannot open them), spelled so
#: that this file does not name them itself.
OUTSIDE = tuple(
    word.replace("+", "")
    for word in ("dra-con+tract", "kubelet-con+tract", "host-test+ing.md", "prior-a+rt.md", "sha+red/ref", "STY+LE.md")
)


#: What .gitignore leaves out, for a tree read without git.
IGNORED = {".git", ".venv", ".cache", "build", "dist", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
IGNORED |= {".hypothesis"}


def project_files() -> list[pathlib.Path]:
    """The project's files: git's list in a checkout; where git cannot tell (``make test-nonroot`` runs the
    suite in a copy without ``.git``, ``make test-trixie`` in a Debian 13 tree without git), every file
    under the root but what .gitignore leaves out."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    except FileNotFoundError:
        listed = None
    if listed is not None and listed.returncode == 0:
        return [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    files = []
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in IGNORED and not d.endswith(".egg-info")]
        files += [pathlib.Path(top, name) for name in names]
    return files


def test_no_file_cites_a_document_outside_the_repository() -> None:
    citing = []
    for path in project_files():
        if path.suffix in {".pyc", ".deb"} or "_pb" in path.parts or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        citing += [f"{path.relative_to(ROOT)}: {word}" for word in OUTSIDE if word in text]
    assert not citing, "documents outside the repository cited:\n" + "\n".join(citing)
