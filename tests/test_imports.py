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
