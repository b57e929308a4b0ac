"""docs/reference/ is made from the programs' flags and must be current; the flags the
documentation names must exist."""

from __future__ import annotations

import re
from pathlib import Path

from tools import reference

ROOT = Path(__file__).resolve().parent.parent

# Flags of other programs the documentation shows (pip, pytest, curl, grpcurl, git, lm-eval, Docker, kubectl).
OTHER_PROGRAMS = {
    "--no-deps",
    "--upgrade",
    "--quiet",
    "--index-url",
    "--extra-index-url",
    "--user",
    "--editable",
    "--requirement",
    "--json",
    "--data",
    "--header",
    "--request",
    "--fail",
    "--silent",
    "--show-error",
    "--no-buffer",
    "--output",
    "--model_args",
    "--tasks",
    "--include_path",
    "--batch_size",
    "--limit",
    "--apply_chat_template",
    "--output_path",
    "--log_samples",
    "--num_fewshot",
    "--gen_kwargs",
    "--device",
    "--env-file",
    "--profile",
    "--build",
    "--detach",
    "--scale",
    "--file",
    "--namespace",
    "--from-literal",
    "--from-file",
    "--dry-run",
    "--validate",
    "--strict",
    "--kubernetes-version",
    "--summary",
    "--ignore-missing-schemas",
    "--help",
    "--version",
    "--check",
    "--fix",
    "--durations",
    "--lf",
    "--maxfail",
    "--collect-only",
    "--co",
    "--tb",
    "--frozen",
    "--ff",
    "--exitfirst",
    "--verbose",
}


def test_the_reference_pages_are_current():
    stale = [name for name, text in reference.pages().items() if (reference.FOLDER / name).read_text() != text]
    assert not stale, f"docs/reference/{stale} differ from the programs' flags: run make reference"


def _known_flags() -> set[str]:
    """The services' and tools' flags (their reference), and those the benchmarks, the demo,
    the deploy helpers and the test suite's own options declare."""
    known = set()
    for text in reference.pages().values():
        known.update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    sources = [*(ROOT / "bench").glob("*.py"), *(ROOT / "deploy").glob("*.py"), ROOT / "verifier_service" / "local_run.py"]
    for source in [*sources, ROOT / "tests" / "conftest.py"]:
        text = source.read_text()
        known.update(re.findall(r"""(?:add_argument|addoption)\(\s*["'](--[\w-]+)["']""", text))
        negated = re.findall(r"""add_argument\(\s*["']--([\w-]+)["'][^)]*BooleanOptionalAction""", text)
        known.update(f"--no-{name}" for name in negated)  # argparse adds --no-NAME for these
    return known


def test_every_flag_the_documentation_names_exists():
    known = _known_flags() | OTHER_PROGRAMS
    documents = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    unknown = {}
    for document in documents:
        text = document.read_text()
        if document.name == "CHANGELOG.md":  # the renames' own entry names the former flags
            text = re.sub(r"^- Flags renamed.*$", "", text, flags=re.MULTILINE)
        found = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]", text)) - known
        if found:
            unknown[str(document.relative_to(ROOT))] = sorted(found)
    assert not unknown, f"flags no program has: {unknown}"


def test_the_check_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reference, "FOLDER", tmp_path)
    monkeypatch.setattr(reference, "ROOT", tmp_path.parent)
    assert reference.main([]) == 0  # writes every page
    (tmp_path / "drafter.md").write_text((tmp_path / "drafter.md").read_text().replace("`1GiB`", "`2GiB`"))
    assert reference.main(["--check"]) == 1
    assert f"{tmp_path.name}/drafter.md" in capsys.readouterr().err
    assert reference.main([]) == 0 and reference.main(["--check"]) == 0
