"""The setup scripts install with uv from exactly where pip would (scripts/_install.sh): pip's own
settings, from its config files and PIP_* variables, become uv's; uv's own, where set, win; pip's
flags reach uv in uv's spelling."""

import os
import subprocess
import sys

from tests.conftest import REPO

UV_KEYS = ("UV_DEFAULT_INDEX", "UV_INDEX", "UV_INDEX_STRATEGY", "UV_FIND_LINKS", "UV_CONSTRAINT", "SSL_CERT_FILE")


def _uv_env(tmp_path, config: str, **env) -> dict:
    """uv's environment as scripts/_install.sh derives it from a pip config file (and env); with
    no config, pip reads none (os.devnull: not even the machine's own files)."""
    (tmp_path / "pip.conf").write_text(config)
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True, exist_ok=True)
    (venv / "python").unlink(missing_ok=True)
    (venv / "python").symlink_to(sys.executable)  # the real pip reads the config
    show = "; ".join(f'echo "{k}=${{{k}:-}}"' for k in UV_KEYS)
    script = f'. scripts/_install.sh && _pip_config_for_uv "{tmp_path / "venv"}" && {show}'
    pip_config = str(tmp_path / "pip.conf") if config else os.devnull
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PIP_CONFIG_FILE": pip_config}
    r = subprocess.run(["bash", "-c", script], cwd=REPO, env={**base, **env}, capture_output=True, text=True,
                       check=True)
    return dict(line.split("=", 1) for line in r.stdout.splitlines())


def test_pips_settings_become_uvs(tmp_path):
    got = _uv_env(tmp_path, "[global]\nindex-url = https://mirror.example/simple\n"
                            "extra-index-url = file:///opt/a/simple file:///opt/b/simple\n"
                            "find-links = /opt/wheels\nconstraint = /etc/caps.txt\ncert = /etc/ca.pem\n")
    assert got == {"UV_DEFAULT_INDEX": "https://mirror.example/simple",
                   "UV_INDEX": "file:///opt/a/simple file:///opt/b/simple",
                   "UV_INDEX_STRATEGY": "unsafe-best-match",  # pip takes the best version from every index
                   "UV_FIND_LINKS": "/opt/wheels", "UV_CONSTRAINT": "/etc/caps.txt", "SSL_CERT_FILE": "/etc/ca.pem"}


def test_pip_variables_count_and_uvs_own_settings_win(tmp_path):
    got = _uv_env(tmp_path, "[global]\nconstraint = /etc/caps.txt\n", PIP_FIND_LINKS="/srv/wheels",
                  UV_CONSTRAINT="/mine.txt")
    assert got["UV_FIND_LINKS"] == "/srv/wheels" and got["UV_CONSTRAINT"] == "/mine.txt"


def test_nothing_configured_leaves_uv_on_its_defaults(tmp_path):
    assert set(_uv_env(tmp_path, "").values()) == {""}


def test_pips_flags_reach_uv_in_its_spelling(tmp_path):
    """`venv_install` hands uv pip's arguments, --force-reinstall spelled --reinstall, and compiles
    bytecode at install only where PYTHONDONTWRITEBYTECODE is set (a uv on PATH that records its
    arguments stands in: installing is what the setup from nothing in CI proves)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "uv").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "args"}\n')
    (bin_ / "uv").chmod(0o755)
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    env = {"PATH": f"{bin_}:{os.environ['PATH']}", "HOME": str(tmp_path), "PIP_CONFIG_FILE": os.devnull}
    for no_bytecode, compile in (("1", ["--compile-bytecode"]), ("", [])):  # compiled where none is written
        subprocess.run(["bash", "-c", f'. scripts/_install.sh && venv_install "{tmp_path / "venv"}" --no-deps '
                                      "--force-reinstall ./x -c c.txt"], cwd=REPO,
                       env={**env, "PYTHONDONTWRITEBYTECODE": no_bytecode}, check=True)
        assert (tmp_path / "args").read_text().split() == [
            "pip", "install", "--quiet", *compile, "--python", f"{tmp_path}/venv/bin/python", "--no-deps",
            "--reinstall", "./x", "-c", "c.txt"]
    env["DRAFTSMITH_INSTALLER"] = "pip"  # pip always: the stand-in is not called
    (tmp_path / "args").unlink()
    r = subprocess.run(["bash", "-c", f'. scripts/_install.sh && _uv_for "{tmp_path / "venv"}"'], cwd=REPO, env=env)
    assert r.returncode == 1 and not (tmp_path / "args").exists()
