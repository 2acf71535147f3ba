"""The commands other than ``run``: ``check-config``, ``probe``, ``doctor``, ``dra-manifests``, ``reload``,
``switch-mode``.

``cli`` dispatches to them; they may use both modes' modules, the daemon never imports them. Beside them,
the command line: ``args`` (its grammar, argparse) and ``runline`` (the unit's `run` line, read without it).
"""
