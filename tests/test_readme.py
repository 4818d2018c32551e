"""The README's embedding example is code that runs, not prose that rots; and its links hold."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from nasiko_queue.cli import main
from nasiko_queue.secrets import generate_master_key

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RULES = ROOT / "docs" / "rules.md"

#: A mention of the behaviour contract this project was built from, which lives
#: outside the repository: a reader who follows it finds nothing.
_ABSENT_CONTRACT = re.compile(r"\bSPEC\b|shared/")


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


async def test_embedding_example_runs(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    example = _python_blocks()[0]  # the embedding example (the second is a sketch)
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(example, str(README), "exec"), namespace)  # noqa: S102
    await namespace["main"](dsn, generate_master_key())  # type: ignore[operator]
    assert capsys.readouterr().out.strip().splitlines()[-1] == "done"


def _block(marker: str) -> str:
    """The README's python block whose first line is ``# readme: <marker>``."""
    [block] = [b for b in _python_blocks() if b.startswith(f"# readme: {marker}\n")]
    return block


def _module(marker: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Run a README block as a module of its own (attrs resolves its annotations
    through `sys.modules`, as for any module the application writes)."""
    module = types.ModuleType(f"readme_{marker.replace(' ', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(_block(marker), str(README), "exec"), module.__dict__)  # noqa: S102
    return module


async def test_plain_jobs_example_runs(dsn: str, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    await _module("plain jobs", monkeypatch).main(dsn)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "done"
    # The urgent one and the welcome one (once); the digest was cancelled. (Their
    # order is the slots', four at once; priority is tested in test_plain_jobs.)
    assert sorted(out[:-1]) == ["sending urgent to ops@example.com attempt 1",
                                "sending welcome to b@example.com attempt 1"]


async def test_dead_letters_example_runs(dsn: str, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The triage loop retries an hour-old dead email job, and it is waiting again."""
    import uuid

    from nasiko_queue import QueueConfig, open_database

    async with open_database(dsn) as db:
        job_id = uuid.uuid4()
        await db.execute(
            "INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, state, attempt, "
            "max_attempts, error_msg, finished_at) VALUES ($1, 'email', 'send_email', "
            "'{\"kind\": \"send_email\"}', 'discarded', 5, 5, 'SMTPError: refused', "
            "now() - interval '2 hours')", job_id)
        await _module("dead letters", monkeypatch).triage(db, QueueConfig())
        row = await db.fetchrow("SELECT state, attempt FROM nasiko_queue_jobs WHERE id = $1",
                                job_id)
    assert (row["state"], row["attempt"]) == ("available", 0)
    assert capsys.readouterr().out.split() == [str(job_id), "send_email", "SMTPError:",
                                               "refused", "0"]


async def test_cron_example_runs(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's schedules enqueue their ticks (the checks: tests/test_schedules.py)."""
    from nasiko_queue import Queue, open_database

    from .test_schedules import enqueue_the_readme_ticks, readme_cron_example

    assert _block("cron") == readme_cron_example()
    async with open_database(dsn) as db:
        await enqueue_the_readme_ticks(Queue(db), _module("cron", monkeypatch).SCHEDULES)


def _setup_commands() -> list[str]:
    """The commands of the README's "Set up" section, each `a && b` split, comments dropped."""
    section = README.read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.DOTALL)
    return [command.strip() for block in blocks for line in block.splitlines()
            for command in line.split("#", 1)[0].split("&&") if command.strip()]


def test_readme_names_the_setup_commands() -> None:
    assert _setup_commands() == [
        "pip install .", "nasiko-queue demo",
        "pip install '.[test]'", "python -m pytest",
        'python -m pytest -m "not slow"',
    ]


def test_ci_runs_the_readme_setup_commands_as_printed() -> None:
    """`.ci/run` proves the README's commands only if it runs them, letter for letter."""
    ci = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    for command in _setup_commands():
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
        link = r"\]\(#([\w-]+)\)" if path == RULES else r"docs/rules\.md#([\w-]+)"
        for anchor in re.findall(link, text):
            assert anchor in anchors, f"{path.name}: #{anchor}"
        for number in re.findall(r"docs/rules\.md §(\d+)", text):
            assert number in numbers, f"{path.name}: docs/rules.md §{number}"
