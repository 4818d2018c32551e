"""The README's embedding example is code that runs, not prose that rots."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nasiko_queue.secrets import generate_master_key

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


async def test_embedding_example_runs(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    example = _python_blocks()[0]  # the embedding example (the second is a sketch)
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(example, str(README), "exec"), namespace)  # noqa: S102
    await namespace["main"](dsn, generate_master_key())  # type: ignore[operator]
    assert capsys.readouterr().out.strip().splitlines()[-1] == "done"


def test_readme_names_the_two_setup_commands() -> None:
    text = README.read_text()
    assert "nasiko-queue demo" in text
    assert "python -m pytest" in text
