"""DRA mode: ate-devplugd as a Dynamic Resource Allocation driver (kubelet 1.32 and later).

The daemon starts ``mode.DraMode`` (which drives ``driver.DraDriver``; see driver.py for the order of
calls); ``config.from_mapping`` checks the ``[dra]`` table; ``manifests.render`` makes
``ate-devplugd dra-manifests``. Nothing is imported here: the package's modules that need aiohttp and
PyYAML load only in DRA mode.
"""
