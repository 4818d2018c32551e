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
from typing import ClassVar

import attrs
import click
import trio

from nasiko_queue import Executors, JobArgs, PlainJobContext, Queue

from .helpers import running
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
    # The CLI reference, generated from the click commands (mkdocs-click): every
    # command and its options are on the page.
    from nasiko_queue.cli import main

    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    for name, command in main.commands.items():
        if command.hidden:
            continue
        assert f"nasiko-queue {name}" in cli, name
        for option in (p.opts[0] for p in command.params
                       if isinstance(p, click.Option) and not p.hidden):
            assert option in cli, (name, option)


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



# -- every other code block ---------------------------------------------------------

#: The code blocks of the README and the docs that are not one of the python
#: programs tests/test_readme.py runs, each (file, first line) with the test that
#: runs it or checks it. A new block that is in none fails
#: `test_every_other_block_is_run_or_checked`.
OTHER_BLOCKS = {
    ("README.md", "pip install '.[demo]' && nasiko-queue demo"):
        "test_readme.test_ci_runs_the_readme_setup_commands_as_printed (CI runs both)",
    ("README.md", 'python -m pytest -m "not slow"'):
        "test_readme.test_readme_names_the_setup_commands (a subset of the full run)",
    ("README.md", "# quickstart: myapp/jobs.py"): "test_the_quickstart_runs_as_printed",
    ("README.md", "# quickstart: commands"): "test_the_quickstart_runs_as_printed",
    ("docs/development.md", "pip install -e '.[dev]'"):
        "test_the_development_commands_are_the_ones_ci_runs",
    ("docs/guides/clients.md", "-- readme: trigger"): "test_enqueue_function.test_from_a_trigger",
    ("docs/operations/dashboard.md", "export NASIKO_QUEUE_DASHBOARD_TOKEN=…"):
        "test_the_dashboard_block_serves",
    ("docs/operations/dashboard.md",
     "dashboard on http://127.0.0.1:9182/ (actions need the token)"):
        "test_the_dashboard_prints_the_lines_the_docs_show",
    ("docs/design/layout.md", "docs/rules.md"):
        "test_the_layout_names_every_module_and_migration",
    ("docs/operations/health.md", "livenessProbe:"): "test_the_probes_block_names_served_paths",
}


def _blocks() -> list[tuple[str, str, str, str]]:
    """(file, language, first line, body) of every fenced block of README and docs."""
    found = []
    for path in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        for _indent, language, body in re.findall(r"^( *)```(\w*)\n(.*?)^\1```",
                                                  path.read_text(), flags=re.DOTALL | re.MULTILINE):
            # The first line up to its comment or column gap: what a reader types.
            lines = [re.split(r"\s{2,}", line.strip())[0] for line in body.splitlines()
                     if line.strip()]
            found.append((path.relative_to(ROOT).as_posix(), language, lines[0], body))
    return found


def _other_block(name: str, first: str) -> str:
    [body] = [b for path, _lang, line, b in _blocks() if (path, line) == (name, first)]
    return body


def test_every_other_block_is_run_or_checked() -> None:
    others = {(path, first) for path, language, first, _ in _blocks()
              if not (language == "python" and first.startswith("# readme: "))}
    assert others == set(OTHER_BLOCKS)


def test_the_development_commands_are_the_ones_ci_runs() -> None:
    """The contributor's commands: each is what `.ci/run` runs (or its subset), so a
    renamed tool or a changed command fails here instead of rotting on the page."""
    ci = (ROOT / ".ci" / "run").read_text()
    body = _other_block("docs/development.md", "pip install -e '.[dev]'")
    commands = [line.split("#", 1)[0].strip() for line in body.splitlines() if line.strip()]
    for command in commands:
        for part in command.split("&&"):
            part = part.strip()
            if part == "bash .ci/run":
                continue
            assert part.split()[0] in ci, part
            assert part in ci or part.startswith(
                ("pip install -e", 'python -m pytest -m "not slow"')), part


@attrs.frozen
class _Noop(JobArgs):
    kind: ClassVar[str] = "noop"


async def _noop(ctx: PlainJobContext[_Noop]) -> None:
    """A worker runs at least one kind."""


async def test_the_probes_block_names_served_paths(queue: Queue) -> None:
    """The Kubernetes probes: valid YAML whose paths a worker's HTTP service answers
    with 200, on the port the guide gives `--http`."""
    import yaml

    from nasiko_queue.web.bind import DEFAULT_PORT

    from .test_http import serving, until

    probes = yaml.safe_load(_other_block("docs/operations/health.md", "livenessProbe:"))
    assert set(probes) == {"livenessProbe", "readinessProbe"}
    executors = Executors()
    executors.register(_Noop)(_noop)
    async with running(queue, executors) as worker, serving(queue, worker) as (_, client):
        for probe in probes.values():
            assert probe["httpGet"]["port"] == DEFAULT_PORT
            path = probe["httpGet"]["path"]

            async def answers(path: str = path) -> bool:
                return (await client.get(path)).status_code == 200

            await until(answers, path)


async def _dashboard(dsn: str, tmp_path: Path, argv: list[str], env: dict[str, str],
                     token: str | None) -> str:
    """Run `nasiko-queue dashboard` (argv after the command) on a free port until it
    serves; log in (with `token`, else the login URL it prints); Ctrl-C; its output."""
    import httpx

    from .test_http import _free_port, until

    port = _free_port()
    out = tmp_path / "dashboard.out"
    with out.open("wb") as sink:
        proc = await trio.lowlevel.open_process(
            [str(NASIKO_QUEUE), *argv, "--bind", f"127.0.0.1:{port}"], cwd=tmp_path,
            env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                     timeout=5.0) as client:

            async def up() -> bool:
                assert proc.returncode is None, "the dashboard exited"
                try:
                    return (await client.get("/")).status_code == 200
                except httpx.TransportError:  # not listening yet
                    return False

            await until(up, "the dashboard to serve", 60.0)
            login = (f"/login?token={token}" if token is not None else
                     out.read_text().split("log in at ", 1)[1].split()[0])
            assert (await client.get(login)).status_code == 303
            assert "/logout" in (await client.get("/")).text
        proc.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
    return out.read_text().replace(str(port), "9182")


async def test_the_dashboard_block_serves(dsn: str, tmp_path: Path) -> None:
    """The dashboard's command as printed, the `…` standing for the reader's token
    and DSN, on a free port rather than 9182 (`--bind`, so that another program on
    the machine cannot answer for it): it serves, the token logs in, Ctrl-C ends it."""
    body = _other_block("docs/operations/dashboard.md", "export NASIKO_QUEUE_DASHBOARD_TOKEN=…")
    [export, command] = [line.split("#", 1)[0].strip() for line in body.splitlines()
                         if line.strip()]
    assert export == "export NASIKO_QUEUE_DASHBOARD_TOKEN=…"
    argv = shlex.split(command.replace("postgresql://…", dsn))
    assert argv[:2] == ["nasiko-queue", "dashboard"]
    token = "t" * 32
    env = {**example_env(dsn), "NASIKO_QUEUE_DASHBOARD_TOKEN": token, "PYTHONPATH": ""}
    await _dashboard(dsn, tmp_path, argv[1:], env, token)


async def test_the_dashboard_prints_the_lines_the_docs_show(dsn: str, tmp_path: Path) -> None:
    """With no token set, the dashboard prints what the page shows (the token
    aside), and its login URL logs in."""
    shown = _other_block("docs/operations/dashboard.md",
                         "dashboard on http://127.0.0.1:9182/ (actions need the token)")
    env = {k: v for k, v in example_env(dsn).items() if k != "NASIKO_QUEUE_DASHBOARD_TOKEN"}
    printed = await _dashboard(dsn, tmp_path, ["dashboard", "--dsn", dsn],
                               {**env, "PYTHONPATH": ""}, None)
    for line in shown.strip().splitlines():
        pattern = re.escape(line.strip()).replace(re.escape("3q2-…"), r"\S+")
        assert re.search(pattern, printed), (line, printed)


def test_the_layout_names_every_module_and_migration() -> None:
    """"Where things live": each module and migration it names exists, and each of
    the package's modules and every migration is named (a new file is placed)."""
    tree = _other_block("docs/design/layout.md", "docs/rules.md")
    named = set(re.findall(r"\b[a-z_0-9]+\.py\b", tree))
    modules = {p.name for p in (ROOT / "nasiko_queue").rglob("*.py") if p.name != "__init__.py"}
    elsewhere = {p.name for d in ("benchmarks", "tests") for p in (ROOT / d).rglob("*.py")}
    assert named - modules - elsewhere == set(), "named but gone"
    assert modules - named == set(), "modules the layout does not place"
    migrations = {p.name for p in (ROOT / "migrations").glob("*.sql")}
    assert set(re.findall(r"\b\d{4}_\w+\.sql\b", tree)) == migrations
