"""Thin CLIs, one per DVC stage: read params.yaml -> call the library -> write outputs."""
