"""
What `pip install nasiko-queue` brings, and what the console script says without its extra
(issue #46: a slim core).

An application that embeds the queue needs the engine, the clients and their
drivers, nothing more: no PostgreSQL binaries (pgserver, 34 MB), no CLI toolkit, no
web stack. pip resolves the checkout's core requirements without installing them
(`--dry-run --report`), so the test reads the same list a user's image would get.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Distributions that only an extra may bring.
NOT_IN_THE_CORE = {"pgserver", "click", "rich", "starlette", "hypercorn", "jinja2",
                   "prometheus-client", "fastapi", "django", "psycopg", "httpx", "httpx2",
                   "playwright", "pytest", "hypothesis", "matplotlib"}


def _normal(name: str) -> str:
    return name.lower().replace("_", "-")


def test_the_core_install_brings_no_server_binaries_cli_or_web_stack(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
         "--no-build-isolation", "--quiet", "--report", str(report), str(ROOT)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    installs = json.loads(report.read_text())["install"]
    brought = {_normal(item["metadata"]["name"]) for item in installs}
    print("pip install nasiko-queue brings:", ", ".join(sorted(brought)))
    assert {"nasiko-queue", "trio", "trio-asyncio", "asyncpg", "attrs", "cattrs",
            "cronsim", "cryptography"} <= brought
    assert brought & NOT_IN_THE_CORE == set()


def test_the_command_without_its_extra_says_which_to_install(tmp_path: Path) -> None:
    """The console script with click hidden, as in a core install: one line, exit 1."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(textwrap.dedent("""
        import sys
        class NoClick:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in ("click", "rich"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None
        sys.meta_path.insert(0, NoClick())
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    done = subprocess.run([sys.executable, "-m", "nasiko_queue", "status"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "nasiko-queue: the command line needs the 'cli' extra (click is not installed): "
        "pip install 'nasiko-queue[cli]'"]
