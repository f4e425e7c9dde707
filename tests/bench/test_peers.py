"""Peer tools install into a venv of their own, once, from whatever index pip is given; offline is a clear error."""

import json
import subprocess
import zipfile

import pytest

from prefixcache.bench.peers import (
    PEER_TOOLS,
    PeerInstallError,
    PeerTool,
    ensure_installed,
    installed,
    llamacpp_command,
    peer_tool,
    tool_dir,
)

FAKE = PeerTool("fake-peer", "1.0", "fake-peer")


def write_wheel(directory, version="1.0"):
    """A pure-Python wheel with one console script, built by hand so the test needs no build backend."""
    dist = f"fake_peer-{version}.dist-info"
    files = {
        "fake_peer/__init__.py": f"def main():\n    print('fake peer {version}')\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: fake-peer\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}/entry_points.txt": "[console_scripts]\nfake-peer = fake_peer:main\n",
    }
    record = "".join(f"{name},,\n" for name in [*files, f"{dist}/RECORD"])
    with zipfile.ZipFile(directory / f"fake_peer-{version}-py3-none-any.whl", "w") as wheel:
        for name, text in {**files, f"{dist}/RECORD": record}.items():
            wheel.writestr(name, text)


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip sees only a local folder of wheels: no network is asked."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def test_a_tool_is_installed_into_its_own_venv_once(tmp_path, local_index):
    write_wheel(local_index)
    root = tmp_path / "peers"
    exe = ensure_installed(FAKE, root)
    assert exe == tool_dir(FAKE, root) / "bin" / "fake-peer"
    assert subprocess.run([exe], capture_output=True, text=True, check=True).stdout == "fake peer 1.0\n"
    assert installed(FAKE, root)
    # a second call reuses the venv as it is: nothing is reinstalled (the wheel is gone, pip could not)
    (local_index / "fake_peer-1.0-py3-none-any.whl").unlink()
    sentinel = tool_dir(FAKE, root) / "kept"
    sentinel.touch()
    assert ensure_installed(FAKE, root) == exe
    assert sentinel.exists()


def test_offline_is_a_clear_error_and_leaves_nothing_half_installed(tmp_path, local_index):
    root = tmp_path / "peers"
    with pytest.raises(PeerInstallError, match=r"cannot install fake-peer==1\.0 .*package index must be reachable"):
        ensure_installed(FAKE, root)
    assert not tool_dir(FAKE, root).exists()
    # once the index has it, the next call installs it
    write_wheel(local_index)
    assert ensure_installed(FAKE, root).is_file()


def test_an_interrupted_install_is_redone(tmp_path, local_index):
    write_wheel(local_index)
    root = tmp_path / "peers"
    (tool_dir(FAKE, root) / "bin").mkdir(parents=True)  # a venv without the marker: cut short
    assert not installed(FAKE, root)
    assert ensure_installed(FAKE, root).is_file()
    assert installed(FAKE, root)


def test_the_known_tools_are_pinned_and_unknown_ones_named():
    assert {t.requirement for t in PEER_TOOLS.values()} >= {"vllm-router==0.1.17", "sglang-router==0.3.2"}
    with pytest.raises(ValueError, match=r"unknown peer tool 'nope'; known: .*vllm-router"):
        ensure_installed("nope")
    with pytest.raises(ValueError, match="version"):
        PeerTool("x", "", "x")


def test_llamacpps_server_runs_from_its_venv_once_installed(tmp_path) -> None:
    tool, script, gguf = peer_tool("xllamacpp"), tmp_path / "serve.py", tmp_path / "m.gguf"
    script.write_text("")
    assert llamacpp_command(gguf, 8300, 2, script, parallel=4, root=tmp_path) is None  # not installed
    python = tool_dir(tool, tmp_path) / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    (tool_dir(tool, tmp_path) / "installed.json").write_text(json.dumps({"requirement": tool.requirement}))
    assert llamacpp_command(gguf, 8300, 2, script, parallel=4, root=tmp_path) == [
        str(python),
        str(script),
        str(gguf),
        "8300",
        "4",
        "2",
    ]
    assert llamacpp_command(gguf, 8300, 2, tmp_path / "missing.py", root=tmp_path) is None  # no serve.py beside us
