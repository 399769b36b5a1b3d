"""deploy/Dockerfile read as a builder would, and its install steps run
without a container engine.

`parse` splits the Dockerfile into stages of instructions (continuations
joined, comments dropped, global ARG defaults substituted in FROM).
`export_context` copies what `docker build .` would send: the repository's
files (tracked and untracked, not git-ignored) less what .dockerignore
excludes. `run_stage` runs one stage's RUN steps with that stage's ENV and
WORKDIR mapped onto temporary directories, so the same commands that build
the image's virtual environment build one here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.processes import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
STEP_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str

    @property
    def exec_form(self) -> list[str] | None:
        """The JSON array of `["a", "b"]` forms (RUN, CMD, ENTRYPOINT)."""
        if not self.value.startswith("["):
            return None
        parsed = json.loads(self.value)
        assert isinstance(parsed, list)
        return [str(item) for item in parsed]


@dataclass(frozen=True)
class Stage:
    base: str
    name: str | None
    instructions: tuple[Instruction, ...] = field(default_factory=tuple)

    def values(self, keyword: str) -> list[str]:
        return [i.value for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        """ENV key=value pairs, in order (later ones win)."""
        found: dict[str, str] = {}
        for value in self.values("ENV"):
            for pair in shlex.split(value):
                key, _, setting = pair.partition("=")
                found[key] = setting
        return found


def _logical_lines(text: str) -> list[str]:
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        # Comment lines are dropped even inside a continuation.
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    if pending:
        lines.append(pending)
    return lines


def parse(path: Path = DOCKERFILE) -> list[Stage]:
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(path.read_text(encoding="utf-8")):
        keyword, _, value = line.partition(" ")
        keyword, value = keyword.upper(), value.strip()
        if keyword == "ARG" and not stages:
            arg, _, default = value.partition("=")
            args[arg] = default
        elif keyword == "FROM":
            words = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m[1] or m[2]], value).split()
            alias = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], alias))
        elif stages:
            last = stages[-1]
            stages[-1] = Stage(
                last.base, last.name, (*last.instructions, Instruction(keyword, value))
            )
    return stages


def _ignore_pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regular expression: `**` crosses
    directories, `*` and `?` do not."""
    parts = re.split(r"(\*\*/|/\*\*|\*\*|\*|\?)", pattern.strip("/"))
    tokens = {"**/": "(?:.*/)?", "/**": "(?:/.*)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(tokens.get(part, re.escape(part)) for part in parts))


def ignored_by(dockerignore: Path) -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in dockerignore.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            rules.append((negated, _ignore_pattern(line.lstrip("!"))))
    return rules


def is_ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its
    parent directories decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negated, pattern in rules:
        if any(pattern.fullmatch(candidate) for candidate in candidates):
            ignored = not negated
    return ignored


def export_context(destination: Path, root: Path = ROOT) -> list[str]:
    """Copies the build context to `destination`; returns its file names."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    rules = ignored_by(root / ".dockerignore")
    copied = []
    for name in filter(None, listed.split("\0")):
        source = root / name
        if not source.is_file() or is_ignored(name, rules):
            continue
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
        copied.append(name)
    return copied


def run_stage(stage: Stage, paths: dict[str, Path], python_dir: Path) -> None:
    """Runs `stage`'s RUN steps in order, with every absolute path of
    `paths` (image path -> temporary directory) rewritten in its ENV and
    commands; WORKDIR becomes its mapped directory. `python_dir` comes first
    on PATH, standing in for the base image's Python."""

    def mapped(text: str) -> str:
        for image_path, local in paths.items():
            text = text.replace(image_path, str(local))
        return text

    env = dict(os.environ)
    env.update({key: mapped(value) for key, value in stage.env().items()})
    env["PATH"] = f"{python_dir}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    cwd = ROOT
    for instruction in stage.instructions:
        if instruction.keyword == "WORKDIR":
            cwd = Path(mapped(instruction.value))
        elif instruction.keyword == "RUN":
            form = instruction.exec_form
            command = (
                [mapped(a) for a in form] if form else ["/bin/sh", "-c", mapped(instruction.value)]
            )
            done = subprocess.run(
                command,
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=STEP_TIMEOUT_S,
                check=False,
            )
            assert done.returncode == 0, (
                f"RUN {instruction.value} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
            )
