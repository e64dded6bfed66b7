"""Parallel-R1: parallel thinking via reinforcement learning, as a reproducible pipeline.

The library holds all the logic and knows nothing of params.yaml, DVC or Prefect;
`stages/` adapts it to DVC and `flows/` to Prefect.
"""

__version__ = "0.1.0"
