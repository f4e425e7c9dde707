"""The cache manager and the command-line parser must not pull in torch (routers and tools embed the core)."""

import subprocess
import sys


def test_core_scheduler_processors_and_cli_parser_import_without_torch():
    code = (
        "import sys\n"
        "import prefixcache, prefixcache.core\n"
        "from prefixcache.cli import build_parser\n"
        "build_parser()\n"
        "from prefixcache.engine import SamplingParams\n"
        "import prefixcache.engine.scheduler, prefixcache.engine.messages\n"
        "import prefixcache.engine.input_processor, prefixcache.engine.output_processor\n"
        "import prefixcache.engine.cache_layout, prefixcache.replay\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _loaded_by(module: str) -> set[str]:
    """The prefixcache modules a fresh interpreter has loaded after importing ``module``."""
    code = f"import sys, {module}\nprint(' '.join(m for m in sys.modules if m.startswith('prefixcache.')))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def _packages(modules: set[str]) -> set[str]:
    return {".".join(m.split(".")[:2]) for m in modules}


def test_the_server_and_the_router_meet_only_in_the_http_package_below_both():
    """The shared HTTP pieces import neither side, the router and the tools never the server's internals, and
    the server never the router: each can change without the other."""
    for module in ("prefixcache.http.anthropic", "prefixcache.http.middleware", "prefixcache.http.flags"):
        assert not _packages(_loaded_by(module)) & {"prefixcache.server", "prefixcache.router"}, module
    for module in (
        "prefixcache.router.app",
        "prefixcache.router.cli",
        "prefixcache.explain.log",
        "prefixcache.explain.sources",
    ):
        assert "prefixcache.server" not in _packages(_loaded_by(module)), module
    assert "prefixcache.router" not in _packages(_loaded_by("prefixcache.server.app"))
