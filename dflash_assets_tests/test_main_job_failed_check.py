"""Issue 32, finding 1, through the main job: a failed blocking check stops the next run too.

The input that showed it: a server answering every prompt with an empty answer (the mission's 87%-empty
dataset). Run 1 fails ``tokenized_sequences``' degenerate-mask check; run 2 saw the stage up to date,
went on to ``hidden_states`` and training and exited 0. Here ``python -m dflash_assets run`` runs twice
against a stand-in server; the target model directory holds the tokenizer but no weights, so a run that
wrongly goes on to ``hidden_states`` fails there at once instead of training for minutes.
"""

from __future__ import annotations

import shutil

from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_simulators.behaviours import Reply
from dflash_simulators.stand_in_server import FakeServer

CHECK = "failed check tokenized_sequences.no_degenerate_mask_length_mode"


def test_the_next_run_makes_the_failed_stage_again_and_goes_no_further(main_job, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ensure_local_model() / name, target / name)
    prompts = [f"Question {i}: say something." for i in range(4)]
    with FakeServer(Reply(content="", reasoning=None, completion_tokens=1)) as server:
        job = main_job(server.url, prompts, partition_size=4, resources={"target_model": {"model_path": str(target)}})
        runs = [job.run(timeout=600) for _ in range(2)]
    first, second = runs
    assert first.returncode == 1 and "no_degenerate_mask_length_mode" in first.stdout, first.stdout[-3000:]
    out = second.stdout
    assert second.returncode == 1, (out + second.stderr)[-3000:]
    # run 2 makes the failed stage again, saying why, and fails it again naming the check
    line = "0000000-0000003: materializing tokenized_sequences, hidden_states (tokenized_sequences: " + CHECK + ")"
    assert line in out, out[-3000:]
    assert "0000000-0000003: materializing hidden_states\n" not in out
    assert "materializing dflash_drafter" not in out and "everything is up to date" not in out
    assert "no_degenerate_mask_length_mode" in out.split("partitions failed:")[1], out[-3000:]
