"""The installed distribution's version, for modules at every layer (``tandem.__version__``)."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("tandem-serve")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
