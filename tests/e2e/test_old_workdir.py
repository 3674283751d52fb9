"""A workdir written before the package was split into layers resumes under today's code: its checkpoint restores
(the integrity checksums verify), training continues from step 2, and the losses after it equal those the old code
logged for the same run trained without a stop (tests/fixtures/make_old_workdir.py made both at commit efc6d56)."""

import json
import shutil
from pathlib import Path

import numpy as np

from helpers import read_jsonl
from jaxtrain import train
from jaxtrain import trainer as trainer_lib

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_a_workdir_made_by_the_old_code_resumes(tmp_path, tiny_data_dir):
    workdir = tmp_path / "old"
    shutil.copytree(FIXTURES / "old_workdir", workdir)
    expected = json.loads((FIXTURES / "old_workdir.json").read_text())
    config = trainer_lib.load_config(workdir)  # its config.json over today's schema
    config.workdir, config.data.dir = str(workdir), tiny_data_dir  # where it lives now; the same data
    config.train.stop_at = 0  # it was stopped at step 2; this run goes on to train.steps
    lines = []
    summary = train.run(config, print_fn=lines.append)

    assert "resumed from checkpoint at step 2" in lines
    assert summary["step"] == 4 and summary["finished"] and summary["resumed"]
    logged = {r["step"]: r["loss"] for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r}
    # Steps 1-2 are the old run's own records; 3-4 are today's code continuing it (8 devices here, one there).
    np.testing.assert_allclose([logged[s] for s in (1, 2, 3, 4)], [expected["losses"][str(s)] for s in (1, 2, 3, 4)],
                               rtol=2e-5)
    np.testing.assert_allclose([loss for _, loss in summary["eval"]], [loss for _, loss in expected["eval"]],
                               rtol=2e-5)
    assert [step for step, _ in summary["eval"]] == [0, 2, 4]
