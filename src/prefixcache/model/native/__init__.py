"""prefixcache's own CPU kernels (C++ sources beside this file), built once per machine on first use.

torch's CPU build has no op for what the decode step needs most on a CPU (attention that reads paged K/V in
place, 4-bit weights times int8-quantized activations), so those kernels are the project's own. They are
compiled with ``torch.utils.cpp_extension`` (g++ and ninja) for the host's instruction set (``-march=native``)
into ``<cache dir>/native/<torch version>-<digest of the host's CPU flags and the sources' folder>/``, keyed by
everything that makes a binary unusable elsewhere (and keeping two installations' builds apart), and loaded as
``torch.ops.prefixcache.*`` (so a compiled step traces them as opaque ops). Building takes about half a minute
on a quiet machine, once; later processes only load the library.

Every caller has a torch fallback: where the kernels cannot be built (no compiler) or are switched off
(``PREFIXCACHE_NATIVE_KERNELS=0``), :func:`native_ops` returns None once, with the reason logged.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
from functools import cache
from pathlib import Path

import torch

from prefixcache.model.cache import cache_dir

logger = logging.getLogger(__name__)

ENV_SWITCH = "PREFIXCACHE_NATIVE_KERNELS"
_SOURCES = Path(__file__).parent
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]


def _host_key() -> str:
    """What the binary depends on besides its sources and flags: torch's version, the CPU's features, and which
    installation's sources it is built from."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        flags = platform.processor()
    digest = hashlib.sha256(f"{platform.machine()} {flags} {_SOURCES.resolve()}".encode()).hexdigest()[:12]
    return f"torch{torch.__version__.replace('+', '_')}-{digest}"


def _ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; a venv's own (the ``ninja`` package) is not on it unless activated."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


@cache
def native_ops() -> object | None:
    """``torch.ops.prefixcache`` with this package's kernels loaded, or None where they are unavailable."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("%s=0: prefixcache's CPU kernels are off, torch's ops run instead", ENV_SWITCH)
        return None
    sources = sorted(str(p) for p in _SOURCES.glob("*.cpp"))
    if not sources:
        return None
    build_dir = cache_dir() / "native" / _host_key()
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        build_dir.mkdir(parents=True, exist_ok=True)
        if not any(build_dir.glob("*.so")):
            logger.warning("building prefixcache's CPU kernels for this machine (once, about a minute)")
        cpp_extension.load(
            name="prefixcache_native",
            sources=sources,
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or ninja, a failed build: the torch fallbacks run
        logger.warning("prefixcache's CPU kernels are unavailable (%s): torch's ops run instead", exc)
        return None
    return torch.ops.prefixcache
