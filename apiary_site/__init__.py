"""Apiary's Django project: settings, the `apiary` entry point and its commands."""

# The one place the version is written: pyproject.toml reads it (tool.setuptools.dynamic),
# `apiary --version` prints it.
__version__ = "0.1.0"
