"""The front door stays true: README.md and docs/*.md link to files that exist, name repository paths that
exist, and show commands that the code can run. Read as text and checked against the source and the parsers;
no process is started and no model is loaded.

    links     every relative markdown link resolves to a file in the repository, and an #anchor into a
              markdown file names one of its headings (GitHub's slugs)
    paths     every `backticked` repository path exists (a glob matches something); absolute paths and
              home-relative ones (/tmp/..., ~/.cache/...) are not the repository's and are skipped
    commands  in ```bash blocks: `bash scripts/X.sh` exists; `rsd SUB` is a subcommand of the `rsd` parser (and
              `rsd generate` / `rsd cluster` flags are theirs, `rsd bench NAME` a benchmark); `python -m X` is
              an importable module; `docker compose --profile P` a compose profile; `-f FILE` exists
    python    ```python blocks compile, and what they import from rsd_api is in rsd_api's __all__
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
# Made by scripts/bootstrap.sh and scripts/gen_protos.py, git-ignored: named in the docs, absent in a checkout.
GENERATED = ("rsd_proto", ".venv")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
PATH_LIKE = re.compile(r"[\w.][\w.*/-]*")
FILE_SUFFIXES = (".py", ".sh", ".md", ".yml", ".yaml", ".toml", ".c", ".h", ".proto", ".json", ".png", ".txt")


def _rel(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a code block's contents are commands or code, checked below)."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(md.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(text: str) -> list[str]:
    return [t for t in LINK.findall(_prose(text)) if not re.match(r"[a-z]+:", t)]


def _broken_links(doc: Path, text: str) -> list[str]:
    broken = []
    for target in _links(text):
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() or not file.is_relative_to(ROOT):
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    return broken


def _repo_paths(doc: Path) -> list[tuple[str, tuple[str, ...]]]:
    """Backticked tokens that name a repository path (a slash inside, or a file suffix), each with the folders a
    bare file name is looked up in: in a table row whose first cell names folders (`rsd/`), those folders."""
    out = []
    for line in _prose(doc.read_text()).splitlines():
        cells = line.split("|")
        folders = tuple(t for t in CODE_SPAN.findall(cells[1]) if t.endswith("/")) if len(cells) > 2 else ()
        for span in CODE_SPAN.findall(line):
            for token in span.split():
                token = token.rstrip(".,;:)")
                if not PATH_LIKE.fullmatch(token) or token.startswith(GENERATED) or token in FILE_SUFFIXES:
                    continue
                if "/" in token or token.endswith(FILE_SUFFIXES):
                    out.append((token, folders))
    return out


def _exists(path: str, folders: tuple[str, ...] = ()) -> bool:
    """A path with a slash from the repository root; a bare file name at the root or in one of `folders`, or
    with none given anywhere in the repository."""
    if "/" not in path:
        if folders:
            return any((ROOT / f / path).exists() for f in ("", *folders))
        return any(".venv" not in p.parts for p in ROOT.rglob(path))
    if any(c in path for c in "*?["):
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_links_resolve(doc):
    broken = _broken_links(doc, doc.read_text())
    assert not broken, f"{_rel(doc)}: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_backticked_paths_exist(doc):
    missing = sorted({p for p, folders in _repo_paths(doc) if not _exists(p, folders)})
    assert not missing, f"{_rel(doc)} names paths that do not exist: {missing}"


OUTSIDE = re.compile(r"/work/|\.\./shared|shared/(?:algorithm|design|models|style)\.md")


def test_no_file_cites_a_path_outside_the_repository():
    """Code, docs, scripts and configs cite files inside the repository, never notes that live beside it.
    Result files are records (they hold the model cache path a run read) and are not checked."""
    suffixes = {".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".c", ".h", ".proto", ".cfg", ""}
    found = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if not path.is_file() or path.suffix not in suffixes or rel.parts[0].startswith(".") or path == Path(__file__):
            continue
        if rel.parts[0] in {"build", "dist", "rsd_proto"} or rel.parts[:2] == ("benchmarks", "results"):
            continue
        if "__pycache__" in rel.parts or any(p.endswith(".egg-info") for p in rel.parts):
            continue
        text = path.read_text(errors="replace")
        found += [f"{rel}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert not found, found


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the rest belongs in docs/"


# ---------------------------------------------------------------------------------------------- commands


def _rsd_parser() -> argparse.ArgumentParser:
    """The `rsd` console script's parser, as rsd_cli builds it (caught at parse time, nothing runs)."""
    import rsd_cli

    caught = []

    class Caught(Exception):
        pass

    def catch(self, args=None, namespace=None):
        caught.append(self)
        raise Caught

    original = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = catch
    try:
        rsd_cli.main(["generate"])
    except Caught:
        pass
    finally:
        argparse.ArgumentParser.parse_known_args = original
    return caught[0]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _commands(doc: Path) -> list[list[str]]:
    """The commands of the doc's ```bash blocks: continuations joined, comments dropped, split at && ; |."""
    out = []
    for lang, body in FENCE.findall(doc.read_text()):
        if lang not in ("bash", "sh"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # a quote opened on this line and closed on another (a JSON body)
                words = shlex.split(line.split("'", 1)[0], comments=True)
            command: list[str] = []
            for w in [*words, ";"]:
                if w in ("&&", ";", "|", "||"):
                    while command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", command[0]):
                        command.pop(0)  # environment assignments before the command
                    if command:
                        out.append(command)
                    command = []
                else:
                    command.append(w)
    return out


def _flags(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if w.startswith("--")]


def _compose_profiles() -> set[str]:
    text = (ROOT / "docker-compose.yml").read_text()
    return {p.strip() for group in re.findall(r"profiles:\s*\[([^\]]*)\]", text) for p in group.split(",")}


def _check_command(words: list[str], rsd: argparse.ArgumentParser) -> str | None:
    """What is wrong with one documented command, or None."""
    program = Path(words[0]).name
    args = words[1:]
    if program == "bash" and args and args[0].endswith(".sh"):
        return None if (ROOT / args[0]).is_file() else f"no script {args[0]}"
    if program in ("python", "python3") and args[:1] == ["-m"]:
        module = args[1]
        return None if importlib.util.find_spec(module) else f"python -m {module}: no such module"
    if program == "rsd":
        sub = _subparsers(rsd)
        if not args or args[0] not in sub:
            return f"rsd {args[:1]}: not a subcommand ({sorted(sub)})"
        if args[0] == "generate":
            unknown = set(_flags(args)) - _options(sub["generate"])
            return f"rsd generate: unknown flags {sorted(unknown)}" if unknown else None
        if args[0] == "cluster":
            from rsd_tools.cluster import build_parser

            unknown = set(_flags(args)) - _options(build_parser())
            return f"rsd cluster: unknown flags {sorted(unknown)}" if unknown else None
        if args[0] == "bench":
            from rsd_bench.cli import BENCHMARKS

            if len(args) < 2 or args[1] not in BENCHMARKS:
                return f"rsd bench {args[1:2]}: not a benchmark ({sorted(BENCHMARKS)})"
        return None
    if program == "docker":
        if "--profile" in args and args[args.index("--profile") + 1] not in _compose_profiles():
            return f"docker compose: no profile {args[args.index('--profile') + 1]}"
        if "-f" in args and not (ROOT / args[args.index("-f") + 1]).is_file():
            return f"docker: no file {args[args.index('-f') + 1]}"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_commands_exist(doc):
    rsd = _rsd_parser()
    wrong = [f"{' '.join(words)[:80]}: {why}" for words in _commands(doc) if (why := _check_command(words, rsd))]
    assert not wrong, f"{_rel(doc)}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_python_blocks_compile_and_import_the_api(doc):
    tree = ast.parse((ROOT / "rsd_api" / "__init__.py").read_text())
    assigns = [n for n in tree.body if isinstance(n, ast.Assign)]
    (api,) = [ast.literal_eval(n.value) for n in assigns if getattr(n.targets[0], "id", "") == "__all__"]
    for lang, body in FENCE.findall(doc.read_text()):
        if lang != "python":
            continue
        code = ast.parse(body)  # a SyntaxError names the line
        for node in ast.walk(code):
            if isinstance(node, ast.ImportFrom) and node.module == "rsd_api":
                assert {a.name for a in node.names} <= set(api), f"{_rel(doc)}: rsd_api has no {node.names}"


def test_the_checks_catch_what_they_should():
    """The parsers above find a broken link, a missing path and an unknown command (a negative control)."""
    rsd = _rsd_parser()
    assert _check_command(["rsd", "frobnicate"], rsd)
    assert _check_command(["rsd", "generate", "--no-such-flag"], rsd)
    assert _check_command(["rsd", "bench", "no_such_benchmark"], rsd)
    assert _check_command(["python", "-m", "rsd_no_such_module"], rsd)
    assert _check_command(["bash", "scripts/no_such.sh"], rsd)
    assert _check_command([".venv/bin/rsd", "generate", "--tiny", "--method", "rsd_s"], rsd) is None
    assert not _exists("rsd/no_such_module.py") and _exists("rsd/acceptance.py") and _exists("rsd_runtime/csrc/*.c")
    assert _exists("acceptance.py", ("rsd/",)) and not _exists("acceptance.py", ("gateway/",))
    readme = ROOT / "README.md"
    assert _broken_links(readme, "[x](docs/no_such.md) [y](docs/algorithm.md#no-such-heading) [z](../../etc/passwd)")
    assert not _broken_links(readme, "[x](docs/algorithm.md#the-methods) [y](https://example.com/a.md) [z](#results)")
    assert _slug("Tree forwards on real models: exact or refused") == "tree-forwards-on-real-models-exact-or-refused"
    assert _slug("The local cluster (`rsd cluster`)") == "the-local-cluster-rsd-cluster"
