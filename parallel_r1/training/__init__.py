"""TRL glue: the cold-start SFT (both variants) and the GRPO rollout/training pieces.

Each module adapts one TRL trainer to the parallel format; the format logic itself stays in
`parallel_r1.format` and the attention structure in `parallel_r1.structure`.
"""
