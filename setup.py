"""Shim for tools that still call setup.py; pyproject.toml is the source of truth."""

from setuptools import setup

setup()
