"""The command line only: argument parsing that calls into the packages."""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
