"""The top-level settings' checks, one per kind of value: each returns the value in effect and adds an
error naming the key and the bad value (as TOML) to ``errors``."""

from __future__ import annotations

import posixpath

from ate_devplugd.base.toml_text import toml_value

LOG_LEVELS = ("debug", "info", "warning", "error")


def boolean(key: str, value: object, errors: list[str]) -> bool:
    if not isinstance(value, bool):
        errors.append(f"{key}: must be true or false, not {toml_value(value)}")
        return False
    return value


def abs_dir(key: str, value: object, errors: list[str]) -> str:
    if not isinstance(value, str):
        errors.append(f"{key}: must be a string, not {toml_value(value)}")
    elif not value.startswith("/") or "\0" in value:
        errors.append(f"{key}: must be an absolute path, not {toml_value(value)}")
    else:
        return posixpath.normpath(value)
    return ""


def metrics_file(value: object, errors: list[str]) -> str:
    if value == "":
        return ""
    if not (isinstance(value, str) and value.startswith("/") and "\0" not in value):
        errors.append(f'metrics_file: must be an absolute path or "" (off), not {toml_value(value)}')
    elif not value.endswith(".prom") or posixpath.basename(value) == ".prom":
        errors.append(
            f"metrics_file: {toml_value(value)} must name a *.prom file "
            "(the only files node_exporter's textfile collector reads)"
        )
    else:
        return posixpath.normpath(value)
    return ""


def runtime_socket(value: object, errors: list[str]) -> str:
    if value == "":
        return ""
    if not (isinstance(value, str) and value.startswith("/") and "\0" not in value):
        errors.append(
            f'runtime_socket: must be an absolute path or "" (the usual runtime sockets), not {toml_value(value)}'
        )
        return ""
    return posixpath.normpath(value)


def log_level(key: str, value: object, errors: list[str]) -> str:
    if isinstance(value, str) and value.lower() in LOG_LEVELS:
        return value.lower()
    errors.append(f"{key}: must be one of {', '.join(LOG_LEVELS)}, not {toml_value(value)}")
    return "info"
