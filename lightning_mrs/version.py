"""The package version (its own module: the swap records it in a config without importing the package root)."""

__version__ = "0.3.0"
