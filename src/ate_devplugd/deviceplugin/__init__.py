"""Device-plugin mode: each resource served over kubelet's device-plugin API v1beta1 and kept registered.

Only the daemon and the commands import this package; DRA mode (``ate_devplugd.dra``) never does.
"""
