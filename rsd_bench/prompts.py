"""The benchmark's prompts: functions of the running interpreter's standard library cut after their
signature and docstring (a fixed module list, drawn with a fixed seed), or JSON lines from a file."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import random
import warnings
from pathlib import Path

# Pure-Python standard-library modules whose module-level functions make the built-in prompt set.
STDLIB_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "codecs", "colorsys", "copy", "csv", "dataclasses",
    "difflib", "dis", "email.utils", "fnmatch", "fractions", "functools", "genericpath", "gettext", "glob",
    "heapq", "html", "inspect", "ipaddress", "json", "keyword", "linecache", "locale", "logging", "mimetypes",
    "ntpath", "os", "platform", "posixpath", "pprint", "quopri", "random", "re", "reprlib", "shlex", "shutil",
    "statistics", "string", "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap", "tokenize",
    "traceback", "types", "urllib.parse", "uuid", "warnings", "zipfile",
)  # fmt: skip
PROMPT_CHARS = (120, 1500)  # prompt length bounds, in characters


def _signature_and_docstring(source: str) -> str | None:
    """The source of a module-level function cut after its docstring, or None when it has no
    docstring or nothing after it."""
    try:
        node = ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or ast.get_docstring(node) is None:
        return None
    if len(node.body) < 2:  # nothing to complete after the docstring
        return None
    lines = source.splitlines()
    return "\n".join(lines[: node.body[0].end_lineno]) + "\n"


def stdlib_candidates() -> list[dict]:
    """Every usable (module, function) of STDLIB_MODULES, sorted: dicts with id, prompt, source."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mod_name in STDLIB_MODULES:
            try:
                module = importlib.import_module(mod_name)
            except ImportError:
                continue
            for name, fn in sorted(vars(module).items()):
                if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                    continue
                try:
                    source = inspect.getsource(fn)
                except (OSError, TypeError):
                    continue
                prompt = _signature_and_docstring(source)
                if prompt and PROMPT_CHARS[0] <= len(prompt) <= PROMPT_CHARS[1]:
                    out.append({"id": f"{mod_name}.{name}", "prompt": prompt})
    return out


def stdlib_prompts(n: int, seed: int) -> list[dict]:
    """n prompts drawn without replacement, with random.Random(seed), from stdlib_candidates()."""
    cands = stdlib_candidates()
    if n > len(cands):
        raise ValueError(f"only {len(cands)} standard-library prompts are available, asked for {n}")
    return random.Random(seed).sample(cands, n)


def file_prompts(path: Path, n: int | None, seed: int) -> list[dict]:
    """JSON lines with a "prompt" field (and an optional "id"); all of them in file order when n is
    None or covers the file, else n drawn with random.Random(seed)."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            obj = json.loads(line)
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
                raise ValueError(f"{path}:{i + 1}: expected a JSON object with a non-empty string 'prompt'")
            rows.append({"id": str(obj.get("id", f"line{i + 1}")), "prompt": obj["prompt"]})
    if n is None or n >= len(rows):
        return rows
    return random.Random(seed).sample(rows, n)
