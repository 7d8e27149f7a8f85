"""Command-line tools: the `flame` command (`flame.tools.cli`) and what it runs."""
