"""The commands other than ``run``: ``check-config``, ``probe``, ``doctor``, ``dra-manifests``, ``reload``,
``switch-mode``.

``cli`` dispatches to them; they may use both modes' modules, the daemon never imports them.
"""
