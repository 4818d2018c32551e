"""The examples of the README and of the documentation site (docs/) are code that
runs, not prose that rots; and their links hold."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import types
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import pytest
import trio
from click.testing import CliRunner

from nasiko_queue.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RULES = ROOT / "docs" / "rules.md"


def documents() -> list[Path]:
    """The README and every page of the documentation site: where examples live."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def documents_text() -> str:
    return "\n".join(path.read_text() for path in documents())

#: A mention of the behaviour contract this project was built from, which lives
#: outside the repository: a reader who follows it finds nothing.
_ABSENT_CONTRACT = re.compile(r"\bSPEC\b|shared/")


def _python_blocks() -> list[str]:
    """Every python block of the README and the docs, but the quickstart's module
    (tests/test_docs.py runs it as the file it is)."""
    return [b for b in re.findall(r"```python\n(.*?)```", documents_text(), flags=re.DOTALL)
            if not b.startswith("# quickstart: ")]


def _block(marker: str) -> str:
    """The python block (of the README or a docs page) whose first line is
    ``# readme: <marker>``."""
    [block] = [b for b in _python_blocks() if b.startswith(f"# readme: {marker}\n")]
    return block


def _module(marker: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Run a README block as a module of its own (attrs resolves its annotations
    through `sys.modules`, as for any module the application writes)."""
    module = types.ModuleType(f"readme_{marker.replace(' ', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(_block(marker), str(README), "exec"), module.__dict__)  # noqa: S102
    return module


#: The README's python blocks that are not programs, by first line, each with why.
#: Every other block starts with ``# readme: NAME`` and is run by `test_readme_block_runs`
#: (a program), or by `test_the_harness_block_passes_under_pytest` (a test file).
NOT_RUNNABLE: dict[str, str] = {}
#: Blocks that are a test file for pytest, not a program.
PYTEST_BLOCKS = ("harness",)


def _marker(block: str) -> str | None:
    first = block.splitlines()[0]
    return first.removeprefix("# readme: ") if first.startswith("# readme: ") else None


def _runnable() -> list[str]:
    return [m for b in _python_blocks() if (m := _marker(b)) is not None]


def test_every_python_block_runs_or_says_why_not() -> None:
    """A block is a program the test below runs, or a sketch named in NOT_RUNNABLE."""
    sketches = [b.splitlines()[0] for b in _python_blocks() if _marker(b) is None]
    assert sketches == list(NOT_RUNNABLE), "a README block is neither run nor excused"
    programs = [m for m in _runnable() if m not in PYTEST_BLOCKS]
    assert sorted(programs) == sorted(_RUNS), "each runnable block needs its check here"
    assert all(m in _runnable() for m in PYTEST_BLOCKS)
    for block in map(_block, programs):
        assert 'if __name__ == "__main__":' in block
        assert "nq.local_database()" in block  # DATABASE_URL, else a server of its own


@attrs.frozen
class _Run:
    """How a block ends, and what it must have printed."""

    #: The stderr line after which it runs until stopped: the test sends SIGINT
    #: there (None: the program ends by itself).
    interrupt_after: str | None = None
    stdout: Callable[[list[str]], bool] = lambda _lines: True


_RUNS = {
    "embedding": _Run(stdout=lambda out: out == ["done"]),
    # The urgent one and the welcome one (once); the digest was cancelled. (Their
    # order is the slots', four at once; priority is tested in test_plain_jobs.)
    "plain jobs": _Run(stdout=lambda out: sorted(out) == [
        "sending urgent to ops@example.com attempt 1",
        "sending welcome to b@example.com attempt 1"]),
    "results": _Run(stdout=lambda out: out == ["https://cdn.example.com/a-64.png"]),
    # A def executor ran in its thread and its result came back (issue #46).
    "def executors": _Run(stdout=lambda out: out == ["6155f67e.png"]),
    # Limits across replicas (issue #23): each call ran; 4 starts in the window.
    "limits": _Run(stdout=lambda out: sorted(out) == [
        "api 2 Rate(limit=10, per=60.0) 4", "calling for acme", "calling for acme",
        "calling for acme", "calling for globex"]),
    "workflows": _Run(stdout=lambda out: out == [
        "2 notes, approved by ana",
        "completed [('plan', 0, 'completed'), ('search', -1, 'completed')]"]),
    "cron": _Run(interrupt_after="Ctrl-C or SIGTERM once"),
    "dead letters": _Run(stdout=lambda out: out == [
        "notify ConnectionError: SMTPError: refused (1 error kept)",
        "sent to ops@example.com on attempt 1"]),
    "health": _Run(interrupt_after="Ctrl-C or SIGTERM once"),
    # Enqueue from any application (issue #26): the job a request enqueued ran in
    # the worker thread and its result came back; the view that failed left no job.
    "fastapi": _Run(stdout=lambda out: out == ["https://cdn.example.com/a-64.png"]),
    "django": _Run(stdout=lambda out: out == ["welcome, a@example.com", "signups: 1"]),
}


async def run_program(path: Path, env: dict[str, str], *,
                      interrupt_after: str | None = None,
                      also: Callable[[str], Awaitable[None]] | None = None,
                      ) -> tuple[int, str, str]:
    """Run `python path`; with `interrupt_after`, SIGINT once stderr has that line
    (after awaiting `also(stderr so far)`). Returns the exit code, stdout, stderr."""
    out = path.with_suffix(".out")
    with out.open("wb") as stdout, trio.fail_after(PROGRAM_DEADLINE):
        proc = await trio.lowlevel.open_process(
            [sys.executable, str(path)], stdout=stdout, stderr=subprocess.PIPE,
            env=env, cwd=path.parent)
        try:
            assert proc.stderr is not None
            err = b""
            sent = interrupt_after is None
            while chunk := await proc.stderr.receive_some():
                err += chunk
                if not sent and interrupt_after.encode() in err:  # type: ignore[union-attr]
                    if also is not None:
                        await also(err.decode())
                    proc.send_signal(signal.SIGINT)
                    sent = True
            code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
    return code, out.read_text(), err.decode()


#: Seconds a README program may take, its database's migrations included.
PROGRAM_DEADLINE = 120


def example_env(dsn: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NASIKO_QUEUE_MASTER_KEY", "NASIKO_QUEUE_TEST_DSN")}
    return {**env, "DATABASE_URL": dsn, "PYTHONPATH": str(ROOT)}


async def _health_answers(stderr: str) -> None:
    """The health block's service answers on the port it logged."""
    [where] = re.findall(r"serving health and metrics on http://(\S+)", stderr)
    host, port = where.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(b"GET /health/live HTTP/1.0\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := await stream.receive_some():
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


async def test_the_harness_block_passes_under_pytest(admin_dsn: str, tmp_path: Path) -> None:
    """
    The README's state machine over a user's own executor, saved as a test file
    in a project of its own and run with `python -m pytest` as a reader would:
    its database comes from the shipped plugin. (It used to be a sketch that
    needed this project's own `dsn` fixture; found by a bug hunt of the harness.)
    """
    (tmp_path / "test_my_executor.py").write_text(_block("harness"))
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(NASIKO_QUEUE_TEST_DSN=admin_dsn, PYTHONPATH=str(ROOT))
    with trio.fail_after(PROGRAM_DEADLINE * 3):
        done = await trio.run_process(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
            cwd=tmp_path, env=env, capture_stdout=True, capture_stderr=True, check=False)
    out = done.stdout.decode()
    assert done.returncode == 0, out + done.stderr.decode()
    assert "1 passed" in out


@pytest.mark.parametrize("marker", [m for m in _runnable() if m not in PYTEST_BLOCKS])
async def test_readme_block_runs(marker: str, dsn: str, tmp_path: Path) -> None:
    """Each python block of the README, saved as a file and run with `python` as a
    reader would (DATABASE_URL set, no master key), exits 0; a block that runs until
    stopped is sent Ctrl-C once it says it runs, and ends cleanly: 0, no traceback."""
    run = _RUNS[marker]
    program = tmp_path / "example.py"
    program.write_text(_block(marker))
    code, out, err = await run_program(
        program, example_env(dsn), interrupt_after=run.interrupt_after,
        also=_health_answers if marker == "health" else None)
    assert code == 0, err
    assert run.stdout(out.splitlines()), out
    if run.interrupt_after is not None:
        assert "SIGINT: stopping once the running jobs finish" in err
        assert "Traceback" not in err, err


async def test_cron_example_runs(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's schedules enqueue their ticks (the checks: tests/test_schedules.py)."""
    from nasiko_queue import Queue, open_database

    from .test_schedules import enqueue_the_readme_ticks, readme_cron_example

    assert _block("cron") == readme_cron_example()
    async with open_database(dsn) as db:
        await enqueue_the_readme_ticks(Queue(db), _module("cron", monkeypatch).SCHEDULES)


def _setup_commands(block: int | None = None) -> list[str]:
    """The commands of the README's "Set up" section (or of its `block`-th sh block),
    each `a && b` split, comments dropped."""
    section = README.read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.DOTALL)
    chosen = blocks if block is None else [blocks[block]]
    return [command.strip() for text in chosen for line in text.splitlines()
            for command in line.split("#", 1)[0].split("&&") if command.strip()]


def test_readme_names_the_setup_commands() -> None:
    assert _setup_commands() == [
        "pip install '.[demo]'", "nasiko-queue demo",
        "pip install '.[test]'", "python -m pytest",
        'python -m pytest -m "not slow"',
    ]


def test_ci_runs_the_readme_setup_commands_as_printed() -> None:
    """`.ci/run` proves the README's two set-up commands (the front door) only if it
    runs them, letter for letter. The everyday fast subset is a part of the second;
    CI runs the whole, once, rather than a part of it again."""
    ci = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    front_door = _setup_commands(0)
    assert front_door == ["pip install '.[demo]'", "nasiko-queue demo",
                          "pip install '.[test]'", "python -m pytest"]
    for command in front_door:
        assert command in ci, command


def _user_facing_documents() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md",
            *sorted((ROOT / "docs").rglob("*.md"))]


def test_documents_send_readers_to_docs_rules_not_to_an_absent_spec() -> None:
    assert RULES in _user_facing_documents()
    for path in _user_facing_documents():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not _ABSENT_CONTRACT.search(line), f"{path.name}:{number}: {line}"
    assert "docs/rules.md" in README.read_text()


def test_cli_help_never_cites_an_absent_spec() -> None:
    runner = CliRunner()
    for command in [[], *([name] for name in main.commands)]:
        result = runner.invoke(main, [*command, "--help"])
        assert result.exit_code == 0, result.output
        assert not _ABSENT_CONTRACT.search(result.output), (command, result.output)


def test_links_to_docs_rules_sections_exist() -> None:
    """Every `docs/rules.md#anchor` and `docs/rules.md §n` cited names a heading there."""
    headings = re.findall(r"^#+ (.+)$", RULES.read_text(), flags=re.MULTILINE)
    anchors = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
    numbers = {h.split(".")[0] for h in headings if h[0].isdigit()}
    for path in _user_facing_documents():
        text = path.read_text()
        link = r"\]\(#([\w-]+)\)" if path == RULES else r"(?:docs/|\.\./)rules\.md#([\w-]+)"
        for anchor in re.findall(link, text):
            assert anchor in anchors, f"{path.name}: #{anchor}"
        for number in re.findall(r"docs/rules\.md §(\d+)", text):
            assert number in numbers, f"{path.name}: docs/rules.md §{number}"
