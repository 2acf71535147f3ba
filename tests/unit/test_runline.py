"""`run`'s line read without argparse: what it reads is what argparse parses; the rest it leaves to argparse."""

from __future__ import annotations

from pathlib import Path

import pytest

from ate_devplugd import cli
from ate_devplugd.commands import args as cli_args
from ate_devplugd.commands import runline


def parsed(argv: list[str]) -> runline.RunLine:
    parser = cli_args.build_parser()
    ns = parser.parse_args(cli_args.command_first(parser, argv))
    assert ns.command == "run"
    return runline.RunLine.of(ns)


READ = [
    ["run"],
    ["run", "--config", "/etc/x.toml"],
    ["run", "--config=/etc/x.toml"],
    ["run", "--config="],
    ["run", "--config", ""],
    ["run", "--config=a=b"],
    ["run", "--config=-x"],
    ["run", "--log-target", "console", "--log-level", "debug"],
    ["run", "--log-target=journal", "--plugin-dir", "/p", "--dev-root", "/r"],
    ["run", "--config", "/a", "--config", "/b"],
    ["run", "--log-level", "warning", "--log-level=error"],
]


@pytest.mark.parametrize("argv", READ, ids=" ".join)
def test_what_it_reads_argparse_parses_the_same(argv: list[str]) -> None:
    assert runline.read(argv) == parsed(argv)


LEFT_TO_ARGPARSE = [
    [],  # the default command: argparse's command_first finds it
    ["--config", "/x", "run"],
    ["check-config"],
    ["run", "--help"],
    ["run", "-h"],
    ["run", "--conf", "/x"],  # an abbreviation
    ["run", "--nope"],
    ["run", "--config"],  # no value
    ["run", "--config", "-x"],
    ["run", "--log-target", "syslog"],
    ["run", "--log-target=syslog"],
    ["run", "stray"],
    ["run", "--"],
]


@pytest.mark.parametrize("argv", LEFT_TO_ARGPARSE, ids=lambda argv: " ".join(argv) or "(none)")
def test_anything_else_is_left_to_argparse(argv: list[str]) -> None:
    assert runline.read(argv) is None


def test_its_options_are_the_run_parsers() -> None:
    parser = cli_args.build_parser("run")
    (run,) = (action.choices["run"] for action in parser._actions if hasattr(action, "choices") and action.choices)
    given = {option: action for action in run._actions for option in action.option_strings}
    for option, allowed in runline.OPTIONS.items():
        assert option in given
        assert given[option].nargs is None  # one value each
        assert given[option].choices == allowed
    assert set(given) - set(runline.OPTIONS) == {"-h", "--help"}


@pytest.mark.parametrize("argv", [["run", "--config", "{}"], ["--config", "{}", "run"], ["run", "--conf={}"]])
def test_both_readings_reach_the_config(tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Read here or by argparse, `run`'s --config is the file loaded (a bad one: exit 78, naming it)."""
    bad = tmp_path / "bad.toml"
    bad.write_text('plugin_dir = "relative"\n')
    assert cli.main([arg.format(bad) for arg in argv]) == 78
    assert "plugin_dir" in capsys.readouterr().err
