"""The images: the Dockerfile's stages, pins and default commands, and .dockerignore. No Docker engine here, so
the Dockerfile is parsed (its default commands go through the real `hybridserve serve` argument parser and
config loader); the CPU image is built only where `docker info` answers. The compose and KubeRay files are
tests/cluster/test_deploy_cluster.py."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cluster.config_loader import load_config
from cluster.serve_args import parse_serve_args

REPO = Path(__file__).resolve().parents[2]
CPU_PIN = "torch==2.13.0"


@dataclass
class Stage:
    name: str
    base: str  # FROM's image, build ARGs substituted
    args: dict[str, str] = field(default_factory=dict)  # ARG defaults visible in the stage
    steps: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest of the line)

    def runs(self) -> list[str]:
        return [self.sub(rest) for instr, rest in self.steps if instr == "RUN"]

    def sub(self, text: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: self.args.get(m.group(1), m.group(0)), text)


def make_stages(text: str) -> dict[str, Stage]:
    """Stages by name: comment lines dropped, `\\` continuations joined, every FROM named (`AS`)."""
    lines, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
        else:
            lines.append(buf + line)
            buf = ""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current = None
    for line in lines:
        instr, _, rest = line.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "FROM":
            image, name = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest, re.IGNORECASE).groups()
            current = stages[name] = Stage(name, Stage("", "", global_args).sub(image), dict(global_args))
        elif instr == "ARG":
            key, _, value = rest.partition("=")
            (current.args if current else global_args)[key] = value.strip('"')
        else:
            current.steps.append((instr, rest))
    return stages


def pip_installs(run: str) -> list[list[str]]:
    """The argument lists (after `install`) of every `pip install` in a RUN line."""
    found = []
    for part in run.split("&&"):
        words = shlex.split(part)
        for i in range(len(words) - 1):
            if words[i] == "pip" and words[i + 1] == "install":
                found.append(words[i + 2:])
    return found


def requirements_and_constraints(words: list[str]) -> tuple[list[str], list[str]]:
    reqs, constraints, skip = [], [], False
    for i, word in enumerate(words):
        if skip:
            skip = False
        elif word in ("-c", "--constraint"):
            constraints.append(words[i + 1])
            skip = True
        elif word in ("--index-url", "-i", "--extra-index-url", "-r"):
            skip = True
        elif word == "-e" or not word.startswith("-"):
            reqs.extend([] if word == "-e" else [word])
    return reqs, constraints


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return make_stages((REPO / "Dockerfile").read_text())


def test_dockerfile_has_a_cpu_target_and_a_cuda_target_on_a_cuda_base(stages):
    assert {"cpu", "cuda"} <= set(stages)
    assert stages["cpu"].base.startswith("python:3.11") and "cuda" not in stages["cpu"].base
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", stages["cuda"].base)
    copied = [rest for instr, rest in stages["cuda"].steps if instr == "COPY" and "--from=" in rest]
    assert copied and all(rest.startswith("--from=cuda-build ") for rest in copied)
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-devel-ubuntu[\d.]+", stages["cuda-build"].base)  # nvcc for the kernels
    assert stages["cuda-build"].base.split(":")[1].split("-")[0] == stages["cuda"].base.split(":")[1].split("-")[0]


def test_cpu_target_installs_the_cpu_torch_through_the_constraints_file(stages):
    cpu = stages["cpu"]
    installs = [words for run in cpu.runs() for words in pip_installs(run)]
    assert installs, "the cpu stage installs nothing"
    copies = [i for i, (instr, rest) in enumerate(cpu.steps)
              if instr == "COPY" and rest.split()[0] in ("constraints/", ".")]
    first_run = next(i for i, (instr, _) in enumerate(cpu.steps) if instr == "RUN")
    assert copies and copies[0] < first_run, "constraints/ must be in the image before the first pip install"
    for words in installs:
        assert requirements_and_constraints(words)[1] == ["constraints/cpu.txt"], words
    reqs, _ = requirements_and_constraints(installs[0])
    assert reqs == ["torch"] and "download.pytorch.org/whl/cpu" in " ".join(installs[0])  # the CPU wheel index
    assert any(r.startswith(".[") and {"model", "cluster"} <= set(r[2:-1].split(",")) for w in installs[1:]
               for r in requirements_and_constraints(w)[0])
    assert CPU_PIN in (REPO / "constraints/cpu.txt").read_text().split()


def test_no_pip_install_leaves_torch_unpinned(stages):
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    with_torch = {name for name, deps in extras.items() if any(re.match(r"torch\b", d) for d in deps)}
    files = {"constraints/cpu.txt": (REPO / "constraints/cpu.txt").read_text()}
    checked = 0
    for stage in stages.values():
        for run in stage.runs():
            files.update({path: text for text, path in re.findall(r'echo "([^"]*)" > (\S+)', run)})
            for words in pip_installs(run):
                reqs, constraints = requirements_and_constraints(words)
                asks_torch = any(r == "torch" or r.startswith("torch") or (
                    r.startswith(".[") and with_torch & set(r[2:-1].split(","))) for r in reqs)
                pinned = any(r.startswith("torch==") for r in reqs) or any(
                    re.search(r"^torch==\d", files[c], re.MULTILINE) for c in constraints)
                assert pinned or not asks_torch, f"{stage.name}: pip install {' '.join(words)}"
                checked += asks_torch
    assert checked >= 3  # cpu: torch, the project; cuda-build: torch, the project with [cuda]
    assert f"torch=={stages['cuda-build'].args['TORCH_VERSION']}" == CPU_PIN  # both images run the same torch


def test_cuda_build_compiles_the_cuda_extra_against_its_torch(stages):
    installs = [w for run in stages["cuda-build"].runs() for w in pip_installs(run)]
    project = [w for w in installs if any(r.startswith(".[") for r in requirements_and_constraints(w)[0])]
    assert len(project) == 1 and "--no-build-isolation" in project[0]
    (req,) = [r for r in requirements_and_constraints(project[0])[0] if r.startswith(".[")]
    assert {"model", "cluster", "cuda"} <= set(req[2:-1].split(","))


def image_serve_config(stage: Stage, monkeypatch):
    (cmd,) = [rest for instr, rest in stage.steps if instr == "CMD"]
    argv = json.loads(cmd)
    assert argv[:2] == ["hybridserve", "serve"]
    monkeypatch.chdir(REPO)  # the images' WORKDIR holds the repository
    args, settings = parse_serve_args(argv[2:])
    return load_config(args.config, args.overrides, settings)


def test_each_image_serves_by_default_on_its_own_device(stages, monkeypatch):
    for name, device in (("cpu", "cpu"), ("cuda", "cuda")):
        assert ("WORKDIR", "/app") in stages[name].steps  # where compose and KubeRay find configs/
        config = image_serve_config(stages[name], monkeypatch)
        exposed = [rest for instr, rest in stages[name].steps if instr == "EXPOSE"][0].split()
        assert config.http.host == "0.0.0.0" and str(config.http.port) in exposed
        assert config.engine.device == device
        assert (REPO / config.model.path / "config.json").is_file()  # the bundled tiny model is in the image
    cuda = image_serve_config(stages["cuda"], monkeypatch).cluster
    assert cuda.num_gpus_per_rank >= 1 and cuda.max_replicas * cuda.tp_size == 1  # one GPU is enough


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: a pattern excludes a path that it matches, or one of whose parent directories it matches."""
    parts = path.split("/")
    for pattern in patterns:
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            return True
    return False


def test_dockerignore_keeps_what_the_build_needs_and_drops_the_rest():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)  # dockerignored() knows no exceptions
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    packages = re.search(r"include = \[([^\]]*)\]", (REPO / "pyproject.toml").read_text()).group(1)
    needed = ["pyproject.toml", "README.md", "constraints/cpu.txt", "configs/local.yaml", "configs/dgx.yaml"]
    needed += [f for f in tracked if f.startswith("configs/models/tiny-trained/")]
    needed += [f for f in tracked if f.split("/")[0] + "*" in packages.replace('"', "").replace(" ", "").split(",")]
    assert len(needed) > 100
    assert [f for f in needed if dockerignored(f, patterns)] == []
    for dropped in (".git/HEAD", ".venv/bin/python", "out/demo/x.parquet", "tests/conftest.py",
                    "cluster/__pycache__/cli.cpython-311.pyc", "hybridserve.egg-info/PKG-INFO"):
        assert dockerignored(dropped, patterns), dropped


@pytest.mark.heavy
@pytest.mark.timeout(3600)
def test_cpu_image_builds_and_carries_the_cpu_torch():
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"no Docker engine: `docker info` failed ({exc})")
    if info.returncode:
        pytest.skip(f"no Docker engine: `docker info` says {(info.stderr or info.stdout).strip().splitlines()[-1]}")
    tag = "hybridserve:test-cpu"
    subprocess.run(["docker", "build", "--target", "cpu", "-t", tag, "."], cwd=REPO, check=True, timeout=3000)
    probe = "import torch, cluster.serve; print(torch.__version__, torch.version.cuda)"
    out = subprocess.run(["docker", "run", "--rm", tag, "python", "-c", probe], capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    assert out[0].startswith(CPU_PIN.split("==")[1]) and out[1] == "None"
