"""The README's shell commands, as a user pastes them: the first `bash` block under a heading,
line continuations joined, comments dropped, leading VAR=value words split off."""

from __future__ import annotations

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands(heading: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv) of each command in the first ```bash block after `## heading`."""
    text = (ROOT / "README.md").read_text()
    block = text.split(f"\n## {heading}\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        words = shlex.split(line, comments=True)
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        commands.append((env, words))
    return commands
