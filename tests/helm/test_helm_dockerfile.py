"""The image recipe: it cannot be built here (no Docker engine), so we parse it and check
that what it pins agrees with pyproject.toml and the chart."""

from __future__ import annotations

import json
import re

import pytest
import tomllib
import yaml
from tests.helm._helm_chart import CHART, REPO

pytestmark = pytest.mark.integration

INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "USER", "ENTRYPOINT",
                "CMD", "EXPOSE", "LABEL", "HEALTHCHECK", "SHELL", "STOPSIGNAL", "VOLUME", "ONBUILD"}


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, continuations joined.

    Raises:
        ValueError: an unknown instruction, a dangling continuation, or an exec-form
            (JSON) argument that is not a JSON list of strings.
    """
    out: list[tuple[str, str]] = []
    pending = ""
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continuation are ignored by Docker
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        word, _, args = full.partition(" ")
        if word.upper() not in INSTRUCTIONS:
            raise ValueError(f"line {lineno}: unknown instruction {word!r}")
        args = args.strip()
        if word.upper() in ("ENTRYPOINT", "CMD", "SHELL") and args.startswith("["):
            value = json.loads(args)
            if not all(isinstance(x, str) for x in value):
                raise ValueError(f"line {lineno}: exec form must be a list of strings")
        out.append((word.upper(), args))
    if pending:
        raise ValueError("Dockerfile ends inside a line continuation")
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return parse_dockerfile((REPO / "Dockerfile").read_text())


def _args(dockerfile) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in dockerfile if k == "ARG" and "=" in a)


def test_parser_rejects_broken_files():
    with pytest.raises(ValueError):
        parse_dockerfile("FROM x\nRUNN echo\n")
    with pytest.raises(ValueError):
        parse_dockerfile("FROM x\nRUN echo \\\n")
    with pytest.raises(json.JSONDecodeError):
        parse_dockerfile('FROM x\nCMD ["a", \n')


def test_dockerfile_parses_and_starts_from_the_vllm_033_image(dockerfile):
    """The image and the chart's annotation name one vLLM release (0.33.0), inside the range the
    `gpu` extra allows (0.33 and 0.34, issue 35)."""
    kinds = [k for k, _ in dockerfile]
    assert kinds.index("FROM") == min(i for i, k in enumerate(kinds) if k != "ARG")
    assert kinds.count("FROM") == 1
    base = next(a for k, a in dockerfile if k == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: _args(dockerfile)[m.group(1)], base)
    assert base == "vllm/vllm-openai:v0.33.0"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    gpu_pin = [d for d in pyproject["project"]["optional-dependencies"]["gpu"] if d.startswith("vllm")]
    assert gpu_pin == ["vllm>=0.33,<0.35"] and base.endswith(":v0.33.0")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["annotations"]["kvblend.io/vllm-version"] == "0.33.0"


def test_ray_pin_equals_pyproject_and_chart(dockerfile):
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("ray[")]
    extra, version = re.fullmatch(r"ray\[(\w+)\]==([\d.]+)", pin).groups()
    assert _args(dockerfile)["RAY_VERSION"] == version
    runs = " ".join(a for k, a in dockerfile if k == "RUN")
    assert f'"ray[{extra}]==${{RAY_VERSION}}"' in runs
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["annotations"]["kvblend.io/ray-version"] == version
    assert chart["appVersion"] == pyproject["project"]["version"]


def test_image_installs_kvblend_without_replacing_cuda_torch(dockerfile):
    runs = [a for k, a in dockerfile if k == "RUN"]
    (install_run,) = [r for r in runs if "pip install" in r]
    # The constraint file pins the base image's own torch and vllm versions ...
    assert "print(f'torch=={torch.__version__}')" in install_run
    assert "print(f'vllm=={vllm.__version__}')" in install_run
    # ... and the install names only Ray and this repository, under that constraint.
    command = install_run.split("pip install", 1)[1].split("&&", 1)[0].split()
    options = [w for w in command if w.startswith("-")]
    packages = [w for w in command if not w.startswith("-") and w != "/tmp/keep-base.txt"]
    assert options == ["--no-cache-dir", "-c"]
    assert command[command.index("-c") + 1] == "/tmp/keep-base.txt"
    assert packages == ['"ray[default]==${RAY_VERSION}"', "."]
    copied = {a.split()[0] for k, a in dockerfile if k == "COPY"}
    assert {"pyproject.toml", "tiers", "blend", "cluster"} <= copied


def test_image_user_matches_the_chart(dockerfile):
    users = [a for k, a in dockerfile if k == "USER"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    uid = values["podSecurityContext"]["runAsUser"]
    assert users and users[-1].split(":")[0] == str(uid)
    assert values["podSecurityContext"]["runAsNonRoot"] is True
