"""Other projects' tools that the benchmarks compare against, installed on request, each into a venv of its own.

A peer (vllm-router, sglang-router, ...) is a PyPI distribution at a pinned version with a console script.
It goes into ``<cache dir>/peers/<name>-<version>`` (the cache dir is ``$PREFIXCACHE_CACHE_DIR`` or
``~/.cache/prefixcache``), never into prefixcache's own environment, so its dependencies cannot change
ours and two peers cannot clash. Installing is idempotent: a venv whose ``installed.json`` names the
pinned requirement is reused as it is; one without it (an install that failed or was cut short) is
removed and built again. A lock file serializes two processes installing the same tool.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import version as distribution_version
from pathlib import Path

MARKER = "installed.json"
# The side-by-side peers' scripts sit beside the checkout (parents: bench, prefixcache, src, the repository root).
SHARED_PEERS = Path(__file__).resolve().parents[4] / "shared" / "peers"
LLAMACPP_SERVE = SHARED_PEERS / "llamacpp" / "serve.py"
VLLM_CPU_SERVE = SHARED_PEERS / "vllm-cpu" / "serve.sh"
# What pip prints last says why it failed; more is noise in an error message.
_PIP_TAIL_LINES = 12


class PeerInstallError(RuntimeError):
    """A peer tool could not be installed (no network, no such version, a failed build)."""


@dataclass(frozen=True, slots=True)
class PeerTool:
    """``name`` is the PyPI distribution, pinned to ``version``; ``executable`` the console script it installs.

    ``pinned_to_ours`` names dependencies installed at the version prefixcache's own environment has: guidellm
    needs torch, and the torch that runs prefixcache here (a CPU build, on a machine without a GPU) is one pip
    can install, where an unpinned one could be a multi-gigabyte CUDA build.
    """

    name: str
    version: str
    executable: str
    pinned_to_ours: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field in ("name", "version", "executable"):
            value = getattr(self, field)
            if not value or "/" in value or value.strip() != value:
                raise ValueError(f"a peer tool's {field} must be a plain non-empty name, got {value!r}")

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    def requirements(self) -> list[str]:
        """What pip installs: the tool, and each of ``pinned_to_ours`` at the version installed here."""
        return [self.requirement, *(f"{name}=={distribution_version(name)}" for name in self.pinned_to_ours)]


PEER_TOOLS: dict[str, PeerTool] = {
    tool.name: tool
    for tool in (
        PeerTool("vllm-router", "0.1.17", "vllm-router"),
        PeerTool("sglang-router", "0.3.2", "sglang-router"),
        PeerTool("guidellm", "0.8.1", "guidellm", pinned_to_ours=("torch",)),
        # llama.cpp's server in-process (no console script: ../shared/peers/llamacpp/serve.py runs it).
        PeerTool("xllamacpp", "2026.10.11549", "python"),
    )
}


def peer_tool(name: str) -> PeerTool:
    """The pinned tool called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PEER_TOOLS[name]
    except KeyError:
        raise ValueError(f"unknown peer tool {name!r}; known: {', '.join(sorted(PEER_TOOLS))}") from None


def peers_root() -> Path:
    """``<cache dir>/peers``, next to the converted models."""
    from prefixcache.model.cache import cache_dir  # here: the model package imports torch, the CLI parser must not

    return cache_dir() / "peers"


def tool_dir(tool: PeerTool, root: Path | None = None) -> Path:
    return (peers_root() if root is None else root) / f"{tool.name}-{tool.version}"


def executable_path(tool: PeerTool, root: Path | None = None) -> Path:
    return tool_dir(tool, root) / "bin" / tool.executable


def installed(tool: PeerTool, root: Path | None = None) -> bool:
    """Whether the venv holds the pinned requirement, completely installed."""
    marker = tool_dir(tool, root) / MARKER
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("requirement") == tool.requirement and executable_path(tool, root).is_file()


def ensure_installed(tool: PeerTool | str, root: Path | None = None) -> Path:
    """The tool's executable, installing the tool first if it is not installed yet. Raises PeerInstallError."""
    tool = peer_tool(tool) if isinstance(tool, str) else tool
    base = peers_root() if root is None else root
    base.mkdir(parents=True, exist_ok=True)
    with (base / f".{tool.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing it right now; wait for it
        if not installed(tool, base):
            _install(tool, base)
    return executable_path(tool, base)


def _install(tool: PeerTool, root: Path) -> None:
    venv = tool_dir(tool, root)
    shutil.rmtree(venv, ignore_errors=True)  # what a failed attempt left behind
    print(f"installing {tool.requirement} into {venv} (once)", file=sys.stderr)
    try:
        _run([sys.executable, "-m", "venv", str(venv)], f"create a venv at {venv}")
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        _run([*pip, *tool.requirements()], f"install {tool.requirement}")
        if not executable_path(tool, root).is_file():
            raise PeerInstallError(f"{tool.requirement} installed no {tool.executable!r} in {venv / 'bin'}")
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        raise
    (venv / MARKER).write_text(json.dumps({"requirement": tool.requirement}) + "\n")


def _run(command: list[str], what: str) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise PeerInstallError(f"cannot {what}: {exc}") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-_PIP_TAIL_LINES:])
        raise PeerInstallError(
            f"cannot {what} (exit {done.returncode}); the package index must be reachable, or pip pointed at a "
            f"mirror (PIP_INDEX_URL, PIP_FIND_LINKS):\n{tail}"
        )


def llamacpp_command(
    gguf: Path,
    port: int,
    threads: int,
    serve_script: Path = LLAMACPP_SERVE,
    parallel: int = 1,
    root: Path | None = None,
) -> list[str] | None:
    """The command running llama.cpp's server on ``gguf`` with ``parallel`` slots (continuous batching, per-slot
    prompt caching) and ``threads`` threads; None when the xllamacpp peer or ``serve_script`` is not installed.

    The benchmarks that compare with llama.cpp (``bench decode``, ``bench serve-compare``) all start it this way."""
    tool = peer_tool("xllamacpp")
    if not installed(tool, root) or not serve_script.is_file():
        return None
    return [str(executable_path(tool, root)), str(serve_script), str(gguf), str(port), str(parallel), str(threads)]
