"""Where configuration values come from: the TOML file, ``GPUPOOL_*`` variables, flags, secret files.

Each source is read into a `Layer` that remembers, for every value, where it came from (file:line,
env var or flag), so that daemon/config.py, which merges the layers, and daemon/options.py, which
checks the values, can name the source of a bad one. Nothing here knows what the options mean:
only their names.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from daemon.errors import ConfigError

ENV_PREFIX = "GPUPOOL_"

# A layer is a list of (key, raw value, source description, is_text) where is_text means the value
# came as a string (env, flags) and must be parsed, rather than as a typed TOML value.
Layer = list[tuple[str, Any, str, bool]]

# Variables poolctl and jobs use; they share the prefix but are not server options.
_GPUPOOL_CLIENT_VARS = frozenset(
    {"token", "server", "job_id", "attempt", "queue", "worker", "output", "user", "tls_ca"}
)


def read_toml(path: Path) -> Layer:
    """The file's keys, each with its file:line (ConfigError when it cannot be read or parsed)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError("config", str(path), f"cannot read the file ({exc.strerror})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", str(path), f"not valid TOML: {exc}") from None
    lines = text.splitlines()

    def where(key: str) -> str:
        pattern = re.compile(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=")
        for number, line in enumerate(lines, 1):
            if pattern.match(line):
                return f"{path}:{number}"
        return str(path)

    return [(k, v, where(k), False) for k, v in data.items()]


def from_env(env: Mapping[str, str]) -> Layer:
    """Every ``GPUPOOL_<NAME>`` variable but those poolctl and jobs use, as option `name`."""
    layer: Layer = []
    for var, value in env.items():
        if var.startswith(ENV_PREFIX) and var != ENV_PREFIX + "CONFIG":
            name = var[len(ENV_PREFIX) :].lower()
            if name in _GPUPOOL_CLIENT_VARS:
                continue
            layer.append((name, value, var, True))
    return layer


def from_flags(args: argparse.Namespace, options: Iterable[tuple[str, bool]]) -> Layer:
    """The flags given on the command line; `options` are (name, secret) pairs: a secret option
    may also be given as ``--NAME-file``."""
    layer: Layer = []
    for option, secret in options:
        for name in (option, option + "_file") if secret else (option,):
            value = getattr(args, name, None)
            if value is not None:
                layer.append((name, value, "--" + name.replace("_", "-"), isinstance(value, str)))
    return layer


def read_secret(key: str, path: object, source: str) -> str:
    """The contents of the file a ``<name>_file`` key names, less its trailing newline."""
    if not isinstance(path, str):
        raise ConfigError(key, source, "expected a file path (a string)")
    try:
        return Path(path).read_text().rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(key, source, f"cannot read {path}: {exc.strerror}") from None
