"""The installed kvxfer's version, from its package metadata (`--version`)."""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("kvxfer")
    except metadata.PackageNotFoundError:  # imported from a source tree, not installed
        return "unknown (not installed)"
