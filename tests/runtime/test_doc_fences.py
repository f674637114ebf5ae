"""Every code fence of the project's Markdown closes where it is meant to: a closing fence is three
backticks alone on their line. A closing line with text after it (``` A plugin ...) is no fence in
CommonMark, so the block ran on and rendered the last 30 lines of docs/plugins.md as code."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO


def fence_faults(text: str) -> list[str]:
    """The lines at which ``text``'s fences go wrong, and an unclosed fence at its end."""
    faults, opened = [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("```"):
            continue
        if opened and line.strip() != "```":  # text after it: a line of the block, which runs on
            faults.append(f"line {number}: {line.strip()!r} inside the fence opened at line {opened} does not close it")
            continue
        opened = 0 if opened else number
    if opened:
        faults.append(f"the fence opened at line {opened} never closes")
    return faults


def _markdown() -> list[Path]:
    """The tracked-looking Markdown: every file under the repository but hidden folders'."""
    inside = (path for path in REPO.rglob("*.md") if not any(part.startswith(".")
                                                             for part in path.relative_to(REPO).parts))
    return sorted(inside)


def test_every_fence_in_the_markdown_closes():
    files = _markdown()
    assert REPO / "docs" / "plugins.md" in files
    faults = {str(path.relative_to(REPO)): fence_faults(path.read_text()) for path in files}
    assert {name: found for name, found in faults.items() if found} == {}


def test_the_check_finds_the_fence_that_broke_docs_plugins():
    broken = "text\n```bash\npip install x\n``` A plugin that cannot be\nimported.\n"
    assert fence_faults(broken) == [
        "line 4: '``` A plugin that cannot be' inside the fence opened at line 2 does not close it",
        "the fence opened at line 2 never closes"]
    assert fence_faults("```python\nx = 1\n```\n\n```\nplain\n```\n") == []
