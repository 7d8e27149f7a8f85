"""`python -m flame`: the same as the `flame` command."""

from flame.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
