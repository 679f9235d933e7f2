"""Run folders written by earlier versions of nobubble still load and continue exactly.

``tests/data/v2_run`` is a run folder that nobubble's second version (commit 0658c3b, before
the configuration was redrawn into sections) wrote: 2bw with error feedback on two stages, four
steps, a checkpoint at step 2 kept. Its ``config.json`` has the flat keys of that version
(``chunks`` null, as it was saved then) and its metrics hold the losses that version computed for
steps 3 and 4; continuing it from step 2 must give exactly those.
"""

import json
import shutil
import warnings
from pathlib import Path

from nobubble.config import OldSpellingWarning
from nobubble.configure import build_config
from nobubble.runfolder.reading import saved_config
from tests.helpers.pipeline import metrics
from tests.helpers.runs import resume

V2_RUN = Path(__file__).parent / "data" / "v2_run"


def test_a_second_version_config_json_loads():
    cfg = build_config(saved_config(V2_RUN))
    assert (cfg.schedule, cfg.stages, cfg.chunks, cfg.correction) == ("2bw", 2, 1, "ef")
    assert "partition" not in json.loads((V2_RUN / "config.json").read_text())
    assert cfg.partition == "blocks"  # the split of that version, not today's default


def test_a_second_version_run_continues_to_the_losses_that_version_computed(tmp_path):
    run = tmp_path / "v2_run"
    shutil.copytree(V2_RUN, run)
    recorded = {r["step"]: r["train_loss"] for r in metrics(V2_RUN) if "train_loss" in r}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resume(run, "steps=4") == 0
    assert not [w for w in caught if issubclass(w.category, OldSpellingWarning)]  # read silently
    continued = {r["step"]: r["train_loss"] for r in metrics(run) if "train_loss" in r}
    assert continued == recorded  # steps 1-2 kept, 3-4 computed again, bit for bit
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    saved = json.loads((run / "config.json").read_text())
    assert saved["partition"] == "blocks"
    assert saved["correction"] == "ef" and "ef" not in saved  # ef=true, written anew as correction
