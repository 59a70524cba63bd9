"""Installs the import stand-ins of compressed_tensors/__init__.py at interpreter start."""

import importlib

importlib.import_module("compressed_tensors")
