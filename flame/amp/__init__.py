"""Mixed precision: the autocast policy and ``GradScaler``."""
