"""Graph -> Graph passes and the pipeline that runs them in order."""

from flame.ir.passes.pipeline import PIPELINE, run_pipeline

__all__ = ["PIPELINE", "run_pipeline"]
