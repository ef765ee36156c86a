"""The face of routereplay: the ``routereplay`` command line and the end-to-end demo.

This is the one place in the core that reaches the engine and trainer packages, lazily,
per subcommand (``demo`` and ``verify`` start them in subprocesses or import them on
demand); nothing else in ``routereplay`` imports ``engine_patches`` or ``trainer_hooks``.
"""
from routereplay.cli.main import build_parser, main

__all__ = ["main", "build_parser"]
