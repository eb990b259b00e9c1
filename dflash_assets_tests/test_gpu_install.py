"""docs/gpu-node.md's install commands resolve, by pip's own resolver, for a GPU node (issue 38).

Each environment's ``pip install`` lines in the doc's Install section (the project's two as one resolution, SGLang's,
vLLM's) run as ``pip install --dry-run --report`` with ``--ignore-installed --only-binary=:all:``, the manylinux tags
of a glibc-2.35 x86_64 node and the doc's Python version, against PyPI as a GPU node sees it: this machine's
pip configuration (a local wheel folder, a torch cap) is left out. pip 26.3 runs them (its dry run reads metadata only;
``fast-deps`` reads it from each wheel by HTTP range requests, so no wheel is downloaded whole), the three at once.
A conflict fails the test with pip's message; what each resolved to (torch, transformers, sglang, vllm) is printed
(``pytest -s``). Skipped only when PyPI cannot be reached.

causal-conv1d is an sdist whose wheel is a CUDA build: its metadata is made from its own sdist (downloaded once,
its setup.py run with ``CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE``, which changes only what is compiled) and given to the
resolution as a local file. What this proves and what it does not: docs/gpu-node.md, "What CI proves".
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash_assets.common.settings import cache_dir
from dflash_assets.generation.engines.environments import SGLANG_PACKAGES, VLLM_CUDA_PACKAGES

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "gpu-node.md"
PIP = "pip==26.3"  # the pip the doc installs; its dry run downloads no wheel whole
WHEEL = "wheel==0.48.0"  # causal-conv1d's setup.py imports wheel.bdist_wheel
#: A GPU node with glibc 2.35 (Ubuntu 22.04): every manylinux tag it runs (pip expands none of the perennial ones).
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)] + ["manylinux2014_x86_64"]
#: PIP_* variables kept: how to reach PyPI. The others (find-links, constraints, extra indexes) are this machine's.
PIP_REACH = {"PIP_INDEX_URL", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES", "PIP_PROXY"}
TIMEOUT_S = 420
ENVIRONMENTS = {".venv": "project", "/opt/sglang-env": "sglang", "/opt/vllm-env": "vllm"}
KEY_PACKAGES = ("torch", "transformers", "sglang", "sglang-router", "vllm", "flash-linear-attention", "causal-conv1d")


def install_commands() -> dict[str, list[str]]:
    """Environment name -> the arguments of its ``<env>/bin/pip install`` lines, in order, from the fenced bash
    blocks of docs/gpu-node.md's Install section."""
    section = DOC.read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    commands: dict[str, list[str]] = {}
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                argv = shlex.split(part)
                if len(argv) > 2 and argv[0].endswith("/bin/pip") and argv[1] == "install":
                    env = ENVIRONMENTS[argv[0].removesuffix("/bin/pip")]
                    commands.setdefault(env, []).extend(argv[2:])
    return commands


def doc_python() -> str:
    """The Python version the doc's environments are made with (``python3.11 -m venv``): one for all three."""
    section = DOC.read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    (version,) = set(re.findall(r"python(3\.\d+) -m venv", section))
    return version


def pyproject_pins() -> dict[str, str]:
    """Name -> pinned version of the project's dependencies and its ``gpu`` extra, read from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["gpu"]]:
        name, version = requirement.split("==")
        pins[normalized(name.split("[")[0])] = version
    return pins


def test_the_doc_installs_what_the_code_and_pyproject_pin():
    """No network: the doc's commands name the engine environments the code makes and the project's torch pin."""
    commands = install_commands()
    assert commands["sglang"] == list(SGLANG_PACKAGES) == ["sglang==0.5.23", "sglang-router==0.3.2"]
    assert commands["vllm"] == list(VLLM_CUDA_PACKAGES) == ["vllm==0.32.0"]
    project = commands["project"]
    assert f"torch=={pyproject_pins()['torch']}" in project and PIP in project
    assert project[-3:] == ["--no-build-isolation", "-e", ".[gpu]"]
    assert doc_python() == "3.11"  # CI's own Python: pip evaluates dependency markers for the Python running it


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without this machine's pip configuration (PyPI as a GPU node sees it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in PIP_REACH}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


def pypi_unreachable() -> str | None:
    """Why PyPI cannot be reached (None when it answers)."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        with urllib.request.urlopen(f"{index}/pip/", timeout=20) as reply:
            reply.read(1)
    except OSError as exc:
        return f"PyPI unreachable ({index}: {exc}); the GPU install's resolution needs it"
    return None


def resolver_tools(root: Path) -> tuple[str, Path]:
    """``PYTHONPATH`` running pip 26.3 (and wheel) from their wheels, and causal-conv1d's sdist: fetched once into
    ``root`` (the cache), each through a staging folder renamed when complete."""
    wheels, version = root / "wheels", pyproject_pins()["causal-conv1d"]
    conv = root / f"causal-conv1d-{version}"
    if not wheels.is_dir():
        staging = root / f"wheels.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        fetch = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(staging), PIP, WHEEL]
        subprocess.run(fetch, env=clean_env(), check=True, capture_output=True, timeout=300)
        staging.rename(wheels)
    path = os.pathsep.join(str(w) for w in sorted(wheels.glob("*.whl")))
    if not conv.is_dir():
        staging = root / f"causal-conv1d.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        fetch = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "--no-build-isolation"]
        proc = subprocess.run(
            [*fetch, "-d", str(staging), f"causal-conv1d=={version}"],
            env=clean_env(PYTHONPATH=path, CAUSAL_CONV1D_SKIP_CUDA_BUILD="TRUE"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"causal-conv1d's sdist could not be fetched:\n{proc.stdout[-3000:]}"
        staging.rename(conv)
    return path, next(conv.glob("*.tar.gz"))


def normalized(name: str) -> str:
    """A distribution name as PyPI compares them (``causal_conv1d`` -> ``causal-conv1d``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Resolution:
    """One environment's dry run: the command, its exit status, seconds, pip's report and output."""

    argv: list[str]
    returncode: int
    wall_s: float
    report: dict
    output: str

    def versions(self) -> dict[str, str]:
        """Normalized name -> version of every distribution the resolution would install."""
        return {normalized(i["metadata"]["name"]): i["metadata"]["version"] for i in self.report.get("install", [])}

    def summary(self, env: str) -> str:
        found = self.versions()
        keys = ", ".join(f"{k} {found[k]}" for k in KEY_PACKAGES if k in found)
        return f"{env}: {len(found)} distributions in {self.wall_s:.0f} s: {keys}"


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory) -> dict[str, Resolution]:
    """The three dry runs, as the doc's commands say, and one that must conflict, started at once (each is
    network-bound)."""
    if why := pypi_unreachable():
        pytest.skip(why)
    pythonpath, conv_sdist = resolver_tools(cache_dir() / "pip-resolver")
    version = doc_python()
    out = tmp_path_factory.mktemp("resolutions")
    started, procs = {}, {}
    # the install issue 38 found: SGLang beside the project's torch pin, which pip must refuse
    conflict = [f"torch=={pyproject_pins()['torch']}", SGLANG_PACKAGES[0]]
    for env, args in {**install_commands(), "conflict": conflict}.items():
        extra = [str(conv_sdist)] if env == "project" else []
        argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--report", str(out / f"{env}.json")]
        argv += ["--ignore-installed", "--only-binary=:all:", "--use-feature=fast-deps", "--python-version", version]
        argv += [f"--platform={p}" for p in PLATFORMS] + ["--cache-dir", str(cache_dir() / "pip-resolver" / "http")]
        argv += [*args, *extra]
        log = open(out / f"{env}.log", "w+")  # noqa: SIM115 (closed below, after the process ends)
        env_vars = clean_env(PYTHONPATH=pythonpath, CAUSAL_CONV1D_SKIP_CUDA_BUILD="TRUE")
        started[env] = time.monotonic()
        procs[env] = (argv, log, subprocess.Popen(argv, cwd=ROOT, env=env_vars, stdout=log, stderr=subprocess.STDOUT))
    ended: dict[str, float] = {}
    while len(ended) < len(procs) and time.monotonic() - min(started.values()) < TIMEOUT_S:
        ended.update(
            {env: time.monotonic() for env, (_, _, p) in procs.items() if env not in ended and p.poll() is not None}
        )
        time.sleep(0.2)
    results = {}
    for env, (argv, log, proc) in procs.items():
        timed_out = env not in ended
        if timed_out:  # past TIMEOUT_S: pip's output so far says where it was
            proc.kill()
            ended[env] = time.monotonic()
        returncode = proc.wait()
        log.seek(0)
        output = log.read() + (f"\n(killed after {TIMEOUT_S} s)" if timed_out else "")
        log.close()
        report_path = out / f"{env}.json"
        report = json.loads(report_path.read_text()) if report_path.is_file() else {}
        results[env] = Resolution(argv, returncode, ended[env] - started[env], report, output)
        print(results[env].summary(env))
    return results


def check(resolution: Resolution, env: str, expected: dict[str, str]) -> None:
    command = shlex.join(resolution.argv[1:])
    assert resolution.returncode == 0, (
        f"{env}: pip could not resolve docs/gpu-node.md's install (exit {resolution.returncode}, "
        f"{resolution.wall_s:.0f} s):\n{command}\n{resolution.output[-4000:]}"
    )
    found = resolution.versions()
    assert {k: found.get(k) for k in expected} == expected, resolution.summary(env)


def test_the_project_and_its_gpu_extra_resolve_with_the_project_pins(resolutions):
    pins = pyproject_pins()
    expected = {k: pins[k] for k in ("torch", "transformers", "openai", "flash-linear-attention", "causal-conv1d")}
    check(resolutions["project"], "project", {**expected, "dflash-assets": "0.1.0"})
    found = resolutions["project"].versions()
    assert "sglang" not in found and "vllm" not in found
    assert any(k.startswith("nvidia-cuda-runtime") for k in found)  # PyPI's Linux torch is the CUDA build


def test_sglang_0_5_23_resolves_in_its_own_environment(resolutions):
    # SGLang's own pins (its wheel's metadata, issue 38): why it cannot share the project's environment
    expected = {"sglang": "0.5.23", "sglang-router": "0.3.2", "torch": "2.14.1", "transformers": "5.19.0"}
    check(resolutions["sglang"], "sglang", {**expected, "openai": "2.8.0"})


def test_vllm_cuda_resolves_at_the_version_ci_runs_on_cpu(resolutions):
    check(resolutions["vllm"], "vllm", {"vllm": VLLM_CUDA_PACKAGES[0].split("==")[1]})


def test_sglang_beside_the_project_torch_is_refused_with_pips_reason(resolutions):
    """The check is not vacuous: the install the issue found broken fails, and pip says why."""
    refused = resolutions["conflict"]
    assert refused.returncode != 0 and not refused.versions()
    assert "sglang 0.5.23 depends on torch==2.14.1" in refused.output, refused.output[-3000:]


def doc_resolution_table() -> dict[str, tuple[int, dict[str, str]]]:
    """docs/gpu-node.md's "resolves to" table: environment -> (distributions, {name: version} of every
    ``name version`` pair its row names, parenthesized ones included)."""
    section = DOC.read_text().split("| environment | resolves to |", 1)[1].split("\n\n", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not (m := re.match(r"(\d+) distributions: (.*)", cells[1])):
            continue
        pairs = re.findall(r"([A-Za-z0-9][A-Za-z0-9._-]*) (\d[0-9A-Za-z.+-]*)", m.group(2))
        table[cells[0].lower()] = (int(m.group(1)), {normalized(name): version for name, version in pairs})
    return table


def test_the_docs_table_is_what_pip_resolved(resolutions):
    """Issue 49 item 5: the version table of docs/gpu-node.md is read from what this resolver test prints (it
    named openai 3.60.0 for vLLM once the resolver gave 3.63.0): every count and version it states must be pip's
    today; the failure prints the row to write."""
    table = doc_resolution_table()
    assert set(table) == {"project", "sglang", "vllm"}, table
    for env, (count, stated) in table.items():
        found = resolutions[env].versions()
        actual = {name: found.get(name) for name in stated}
        row = f"{len(found)} distributions: " + ", ".join(f"{name} {found.get(name)}" for name in stated)
        assert (count, stated) == (len(found), actual), f"docs/gpu-node.md, {env}: write | {row} |"
