"""DRA mode: ate-devplugd as a Dynamic Resource Allocation driver (kubelet 1.32 and later).

The daemon starts ``mode.DraMode`` (which drives ``driver.DraDriver``; see driver.py for the order of
calls). The ``[dra]`` table is checked by ``ate_devplugd.config.dra`` and the pools it publishes are
``ate_devplugd.config.pools``; ``ate-devplugd dra-manifests`` is ``ate_devplugd.commands.manifests``.
Nothing is imported here: the package's modules that need aiohttp and PyYAML load only in DRA mode.
"""
