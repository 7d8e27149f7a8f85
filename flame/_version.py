"""The one place FLAME's version lives; `flame/__init__.py` and the CLI import it from here."""

__version__ = "0.1.0"
