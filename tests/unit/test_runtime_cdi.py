"""Which runtime socket the daemon asks (the verdict drawn from the answers is in test_runtime_facts.py)."""

from __future__ import annotations

from pathlib import Path

from ate_devplugd.cri.ask import find_socket


def test_find_socket(tmp_path: Path) -> None:
    """The configured socket wins; else the first usual one that exists; else none."""
    a, b = tmp_path / "a.sock", tmp_path / "b.sock"
    b.touch()
    assert find_socket("/x.sock", (str(a), str(b))) == "/x.sock"
    assert find_socket("", (str(a), str(b))) == str(b)
    b.unlink()
    assert find_socket("", (str(a), str(b))) is None
