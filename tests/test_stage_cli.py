"""Every stage is an argparse CLI whose progress lines go through logging set up once in `stage_main`."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from conftest import REPO

STAGES = ("prepare_model", "prepare_data", "generate", "filter", "validate", "sft", "rl", "evaluate",
          "reports")


@pytest.mark.parametrize("name", STAGES)
def test_every_stage_answers_help(name, capsys):
    stage = importlib.import_module(f"stages.{name}")
    with pytest.raises(SystemExit) as exit_info:
        stage.main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m stages.{name}")


def test_progress_lines_print_on_the_main_process_only():
    script = ("from stages.common import log, stage_main\n"
              "stage_main(lambda: log.info('step 1 done'))()\n")
    main = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "RANK": "0"})
    other = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "RANK": "3"})
    assert (main.returncode, main.stdout) == (0, "step 1 done\n")
    assert (other.returncode, other.stdout) == (0, "")
