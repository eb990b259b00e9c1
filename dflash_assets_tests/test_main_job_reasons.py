"""Issue 26, point 4: every partition the main job reports failed carries its reason.

The main job (``python -m dflash_assets run``, a subprocess) against a stand-in server that answers its
start-up probe and fails every row (HTTP 400, not retried): each partition's run fails, and the output
names each failed partition with the step's error, not only "partitions failed: [...]".
"""

from __future__ import annotations

from dflash_simulators.behaviours import Error, Reply
from dflash_simulators.counting_proxy import last_user_message
from dflash_simulators.stand_in_server import FakeServer

PROMPTS = ["p-one", "p-two", "p-three"]


def test_each_failed_partition_is_reported_with_its_reason(main_job):
    def script(n, body):
        if last_user_message(body) not in PROMPTS:
            return Reply()  # the start-up probe
        return Error(400, "the model refuses this prompt")

    with FakeServer(script) as server:
        proc = main_job(server.url, PROMPTS, inference={"max_attempts": 1}).run()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "partitions failed: ['0000000-0000001', '0000002-0000002']" in proc.stdout, proc.stdout[-3000:]
    for pk, rows in (("0000000-0000001", 2), ("0000002-0000002", 1)):
        line = next((x for x in proc.stdout.splitlines() if x.startswith(f"  {pk}: ")), None)
        assert line is not None, proc.stdout[-3000:]
        # the step's error: the partition's rows all failed, quoting the server's message
        assert f"all {rows} rows ended in error" in line and "the model refuses this prompt" in line, line


def test_a_config_with_another_storage_root_is_refused_the_instance_of_the_first():
    """A fresh user ran two configs with different storage roots under one DAGSTER_HOME: the second replaced the
    first's partition keys, and its summary showed the other corpus's truncation rate. Now it stops first."""
    from dflash_assets.app.main_job import other_storage_root

    mine = "/data/a/prompt_corpus/corpus.parquet"
    assert other_storage_root(None, mine, "/home") is None  # a new instance
    assert other_storage_root({"path": mine}, mine, "/home") is None  # the same corpus again
    problem = other_storage_root({"path": mine}, "/data/b/prompt_corpus/corpus.parquet", "/home")
    assert problem.startswith(f"DAGSTER_HOME /home holds the run history of the corpus at {mine}; ")
    assert "/data/b/prompt_corpus/corpus.parquet" in problem and "its own DAGSTER_HOME" in problem
