"""
The documentation site (docs/, mkdocs.yml) builds with no warning, the README
stays a front door, and the README's quickstart works as printed: its module
saved as `myapp/jobs.py`, its commands run one after another with the installed
`nasiko-queue` (issue #46).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import trio

from .test_readme import README, ROOT, example_env

#: The command the package installs, beside this interpreter.
NASIKO_QUEUE = Path(sys.executable).with_name("nasiko-queue")


def _quickstart() -> tuple[str, list[str]]:
    """The quickstart's module and its commands (comments dropped)."""
    text = README.read_text()
    [module] = re.findall(r"```python\n# quickstart: myapp/jobs\.py\n(.*?)```", text,
                          flags=re.DOTALL)
    [commands] = re.findall(r"```sh\n# quickstart: commands\n(.*?)```", text, flags=re.DOTALL)
    return module, [line for line in commands.splitlines() if line.strip()]


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link, a page left out of the nav or a
    missing include fails it (CI runs the same through this test)."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr
    quickstart = (tmp_path / "site" / "quickstart" / "index.html").read_text()
    assert "send_welcome" in quickstart  # the README's quickstart, included


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert {p for p in pages if f": {p}" not in nav} == set()


def test_the_readme_is_a_front_door() -> None:
    """A few hundred lines: what it is, the set-up commands, a quickstart, the API
    in short, the CLI, the guarantees; the rest is on the site."""
    text = README.read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    assert headings == ["Set up", "Quickstart", "Documentation", "CLI", "Guarantees"]
    assert len(text.splitlines()) < 300
    module, _commands = _quickstart()
    assert len(module.splitlines()) <= 30


async def test_the_quickstart_runs_as_printed(empty_dsn: str, tmp_path: Path) -> None:
    """The module as `myapp/jobs.py`; each command with the installed `nasiko-queue`,
    `export DATABASE_URL=...` standing for the reader's database (here the test's,
    not migrated). The worker prints the job's line, then Ctrl-C stops it (0)."""
    module, commands = _quickstart()
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "jobs.py").write_text(module)
    env = {**example_env(empty_dsn), "PYTHONPATH": ""}  # the installed package
    assert commands[0].startswith("export DATABASE_URL=")
    *once, worker = commands[1:]
    for command in once:
        argv = shlex.split(command)
        assert argv[0] == "nasiko-queue"
        with trio.fail_after(120):
            done = await trio.run_process([str(NASIKO_QUEUE), *argv[1:]], cwd=tmp_path,
                                          env=env, capture_stdout=True, capture_stderr=True,
                                          check=False)
        assert done.returncode == 0, (command, done.stderr.decode())
    argv = shlex.split(worker)
    with trio.fail_after(120):
        proc = await trio.lowlevel.open_process(
            [str(NASIKO_QUEUE), *argv[1:]], cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            assert proc.stdout is not None
            out = b""
            while b"\n" not in out:
                chunk = await proc.stdout.receive_some()
                assert chunk, "the worker ended before running the job"
                out += chunk
            proc.send_signal(signal.SIGINT)
            assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
    assert out.decode().splitlines()[0] == "welcome mail to ada@example.com attempt 1"
    assert await _jobs(empty_dsn) == [("send_welcome", "completed", '"sent"')]


async def _jobs(dsn: str) -> list[tuple[str, str, str]]:
    """The jobs table as the quickstart left it (read over its own connection)."""
    from nasiko_queue import open_database

    async with open_database(dsn) as db:
        rows = await db.fetch(
            "SELECT kind, state, result::text AS result FROM nasiko_queue_jobs")
    return [(r["kind"], r["state"], r["result"]) for r in rows]

