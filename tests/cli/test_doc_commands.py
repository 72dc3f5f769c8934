"""Every command in README.md and docs/ as written: each fenced shell block is split into its commands;
every `pagedbatch` command must name a real subcommand and only flags it has, every `python -m` module
and every repository path must exist, and the README's main job runs for real on a tiny model (the
commands that need servers, a cluster or Docker are checked, not run)."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import subprocess
import sys

import pytest

from pagedbatch.cli import build_parser
from tests.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.S | re.M)
# programs that need a server, a cluster, Docker or a shell of their own: their repository paths are checked
ELSEWHERE = {"docker", "kind", "curl", "export", "cp", "mkdir", "cat", "pip", "openssl", "less", "."}


def _blocks():
    for page in PAGES:
        for block in SHELL_BLOCK.findall(page.read_text()):
            yield page.relative_to(REPO), block


def _lines(block: str):
    """The block's command lines: continuations joined, heredoc bodies left out."""
    text = block.replace("\\\n", " ")
    heredoc = None
    for line in text.splitlines():
        if heredoc:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if match := re.search(r"<<'?(\w+)'?", line):
            heredoc = match.group(1)
            line = line[: match.start()]
        yield line


def _commands():
    """(page, argv) for every simple command in a shell block ($VARIABLES and $(...) stay as words)."""
    for page, block in _blocks():
        for line in _lines(block):
            words = shlex.split(line, comments=True)
            command: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", "||", "|", ";", "&", ">", ">>"):
                    if command:
                        yield page, command
                    command = []
                    if word in (">", ">>"):  # a redirection's target is not a command
                        command = None
                elif command is not None:
                    if re.match(r"\w+=\$\(", word):  # JOB=$(pagedbatch submit ...): a command of its own
                        if command:
                            yield page, command
                        command, word = [], word.split("=", 1)[1]
                    word = word.removeprefix("$(").removesuffix(")").strip("[]")  # [--flag]: usage brackets
                    if word:
                        command.append(word)
            if command:
                yield page, command


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _check_pagedbatch(argv: list[str]) -> list[str]:
    parser, rest = build_parser(), argv[1:]
    while rest and (subs := _subcommands(parser)) and not rest[0].startswith("-"):
        if rest[0] not in subs:
            return [f"no subcommand {rest[0]!r} in {' '.join(argv)}"]
        parser, rest = subs[rest[0]], rest[1:]
    flags = {o for action in parser._actions for o in action.option_strings}
    return [
        f"{word.split('=')[0]} is not a flag of {parser.prog}"
        for word in rest
        if word.startswith("--") and word.split("=")[0] not in flags
    ]


def _repo_paths(argv: list[str]) -> list[str]:
    """Words that name a path inside the repository (a top-level entry that exists) but do not exist."""
    missing = []
    for word in argv:
        inside = "/" in word and not word.startswith(("/", "$", "-")) and (REPO / word.split("/")[0]).exists()
        if inside and not (REPO / word.split("=")[-1]).exists():
            missing.append(word)
    return missing


def _check(argv: list[str]) -> list[str]:
    program = argv[0]
    starts = [i for i in range(1, len(argv)) if argv[i] == "pagedbatch" and argv[i - 1] in ("--", "api")]
    if program != "pagedbatch" and starts:  # docker compose exec api pagedbatch ..., kubectl exec ... -- pagedbatch
        return _check(argv[: starts[0]]) + _check(argv[starts[0] :])
    if program == "pagedbatch":
        return _check_pagedbatch(argv) + _repo_paths(argv)
    if program in ("python", "python3") and argv[1:2] == ["-m"]:
        module = argv[2]
        found = importlib.util.find_spec(module) is not None
        return ([] if found else [f"no module {module}"]) + _repo_paths(argv)
    if program in ("python", "python3"):
        return [] if (REPO / argv[1]).is_file() else [f"no script {argv[1]}"]
    if program in ("celery", "gunicorn"):
        app = next((w for w in argv if w.startswith("workers.") or w.startswith("'api.")), None)
        module = (app or "").strip("'").split(":")[0]
        return [] if module and importlib.util.find_spec(module) else [f"no app module in {argv}"]
    if program == "kubectl":  # `deploy/x` is a resource there; the paths follow -k, -f and kustomize
        return _repo_paths([w for before, w in zip(argv, argv[1:]) if before in ("-k", "-f", "kustomize")])
    if program in ELSEWHERE or program.startswith("PAGEDBATCH_") or "=" in program:
        return _repo_paths(argv)
    return [f"unknown program {program!r}: add it to ELSEWHERE if it needs a cluster or server"]


def test_the_pages_have_shell_blocks_and_pagedbatch_commands():
    commands = list(_commands())
    assert {str(page) for page, _ in commands} >= {"README.md", "docs/api.md", "docs/operations.md", "docs/deploy.md"}
    assert sum(argv[0] == "pagedbatch" for _, argv in commands) >= 20


def test_every_documented_command_names_what_exists():
    problems = [f"{page}: {problem}" for page, argv in _commands() for problem in _check(argv)]
    assert not problems, "\n".join(problems)


def test_inline_bench_commands_name_bench_modules():
    """The benchmark tables name their commands inline: `python -m bench.x`."""
    named = {m for page in PAGES for m in re.findall(r"`python -m (bench\.\w+)", page.read_text())}
    assert named, "no benchmark command found"
    assert sorted(m for m in named if importlib.util.find_spec(m) is None) == []


def test_a_wrong_flag_is_caught():
    assert _check(["pagedbatch", "worker", "--model", "x=/m", "--colour", "blue"]) == [
        "--colour is not a flag of pagedbatch worker"
    ]
    assert _check(["pagedbatch", "keys", "destroy"]) == ["no subcommand 'destroy' in pagedbatch keys destroy"]
    assert _check(["python", "-m", "bench.nothing_here"]) == ["no module bench.nothing_here"]


def test_pagedbatch_help_runs():
    out = subprocess.run([sys.executable, "-m", "pagedbatch", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "tiny-model" in out.stdout, out.stderr


@pytest.mark.slow  # loads and runs a model
def test_the_readme_main_job_runs_as_written(tmp_path):
    """The README's first command after its installs (the venv is this one), with /tmp/ as a temporary folder."""
    first = SHELL_BLOCK.search((REPO / "README.md").read_text()).group(1).strip()
    job = first[first.index("pagedbatch tiny-model") :]
    assert job == (
        "pagedbatch tiny-model /tmp/tiny && pagedbatch run examples/requests.jsonl -o results.parquet --model /tmp/tiny"
    )
    (tmp_path / "examples").symlink_to(REPO / "examples")
    done = subprocess.run(
        job.replace("/tmp/", f"{tmp_path}/"), shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "results.parquet").stat().st_size > 0
