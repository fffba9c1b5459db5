"""flarepp's version: the one place it is written (the package metadata reads it)."""

__version__ = "0.1.0"
