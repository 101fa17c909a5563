"""Issue 28, point 7: the post-training tools on a missing workdir or checkpoint: one line naming
what is missing and the command that makes it (checkpoints.RunNotFoundError)."""
from __future__ import annotations

import json

import pytest

from normvit_jax import checkpoints
from normvit_jax.analysis import capture


def test_missing_workdir_config_and_checkpoint_are_named_with_the_command(tmp_path):
    gone = tmp_path / "gone"
    with pytest.raises(checkpoints.RunNotFoundError,
                       match=rf"^{gone} does not exist: train a run there first, e\.g\. python "
                             rf"main\.py --config=configs/vit_ln\.py:demo --workdir={gone}$"):
        checkpoints.load_state(str(gone))
    with pytest.raises(checkpoints.RunNotFoundError, match=r"holds no run \(no config\.json\)"):
        capture.latest_step(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"seed": 0}))
    for call in (lambda: checkpoints.load_params(str(tmp_path)),
                 lambda: capture.latest_step(str(tmp_path))):
        with pytest.raises(checkpoints.RunNotFoundError, match=(
                rf"^no checkpoint in {tmp_path}/checkpoints: the run has not saved one yet; "
                rf"continue it with the command that started it \(same --workdir; its config is "
                rf"{tmp_path}/config\.json\)")):
            call()
    (tmp_path / "checkpoints" / "6").mkdir(parents=True)
    (tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp").mkdir()  # half-written: not a step
    with pytest.raises(checkpoints.RunNotFoundError,
                       match=r"no checkpoint of step 9 in \S+; there are: \[6\]"):
        checkpoints.load_state(str(tmp_path), 9)
    assert capture.latest_step(str(tmp_path)) == 6
