"""llama.cpp beside this project on the same GGUF files, in one run (issue 31).

    python -m rsd_bench.llamacpp --draft D --target T           # each folder holds its .gguf
    python -m rsd_bench.llamacpp --tiny --draft-gguf d.gguf --target-gguf t.gguf --out-dir /tmp  # a smoke run

llama.cpp is built once from the llama-cpp-python sdist (its vendor/llama.cpp, pinned) with -march=native
into ~/.cache/rsd/llamacpp/<version>/ (build_llamacpp). On the same stdlib prompts as rsd's side (raw text,
no chat template), --threads threads pinned to the first cores, it runs the target alone
(llama-completion) and its speculative mode (llama-speculative-simple, one row per --draft-max), one
process per prompt, seed + i for prompt i, greedy at T = 0 and the full law at T > 0 (temperature is the
only sampler). Then rsd's side runs as `python -m rsd_bench.disaggregated` (the target alone on the same
cores, the pipeline per --methods) in a subprocess. One row per (system, method, T): tokens_per_s (all
generated tokens / all prompt + generation time; model loading excluded on both sides), block_efficiency
(tokens per target forward), acceptance (llama.cpp: accepted / drafted), matches_target (T = 0: llama.cpp's
speculative text equals its target alone's; rsd's pipeline tokens equal its target alone's) and
vs_llamacpp_target (tokens/s over llama.cpp's target alone at the same T). Writes <out-dir>/<name>.json
and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rsd_tools.defaults import RESULTS_DIR

# llama.cpp comes vendored in this sdist (vendor/llama.cpp); pinned, so a rerun builds the same code.
LLAMACPP_PYTHON_VERSION = "0.3.36"
TOOLS = ("llama-completion", "llama-speculative-simple")  # target alone; target + draft
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # -march=native: the same CPU features rsd's kernels may use
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",  # older llama.cpp's download support (this version has it off and warns: deprecated)
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
)
BUILD_NICE = 10  # the build shares the machine's cores


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rsd" / "llamacpp"


def build_llamacpp(cache_dir: Path | None = None, version: str = LLAMACPP_PYTHON_VERSION) -> Path:
    """The bin dir holding TOOLS, built from llama-cpp-python's sdist at <cache_dir>/<version>/ once; a rerun
    finds build.json there and builds nothing. The compile runs niced, a job per core this process may use."""
    root = (cache_dir or default_cache_dir()) / version
    bin_dir = root / "bin"
    if (root / "build.json").is_file() and all((bin_dir / tool).is_file() for tool in TOOLS):
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        work = Path(tmp)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(work)]
        subprocess.run([*pip, f"llama-cpp-python=={version}"], check=True)
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        (src,) = work.glob("llama_cpp_python-*/vendor/llama.cpp")
        build = work / "build"
        jobs = len(os.sched_getaffinity(0))  # the cores this process may use: the build is bounded to them
        t0 = time.perf_counter()
        nice = ["nice", "-n", str(BUILD_NICE)]
        subprocess.run([*nice, "cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS], check=True)
        subprocess.run([*nice, "cmake", "--build", str(build), "-j", str(jobs), "--target", *TOOLS], check=True)
        build_s = time.perf_counter() - t0
        bin_dir.mkdir(exist_ok=True)
        for tool in TOOLS:
            shutil.copy2(build / "bin" / tool, bin_dir / tool)
    info = {
        "source": f"llama-cpp-python=={version} (sdist, vendor/llama.cpp)",
        "cmake_flags": list(CMAKE_FLAGS),
        "jobs": jobs,
        "build_s": round(build_s, 1),
        "compiler": _compiler_version(),
    }
    (root / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    return bin_dir


def _compiler_version() -> str:
    out = subprocess.run(["c++", "--version"], capture_output=True, text=True)
    return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else "unknown"


# ---------------------------------------------------------------------------------------------
# One llama.cpp generation


@dataclass(frozen=True)
class LlamaRun:
    """One llama.cpp process: its generated text (prompt excluded) and what it reported."""

    text: str
    num_tokens: int  # generated tokens
    prompt_tokens: int
    wall_s: float  # prompt + generation, as llama.cpp timed it (model loading excluded)
    decode_s: float  # generation alone
    eos: bool | None = None  # an end-of-generation token stopped it (None: the tool does not say)
    num_drafted: int | None = None  # speculative mode only
    num_accepted: int | None = None

    @property
    def num_steps(self) -> int:
        """Target forwards after the prompt: each commits its accepted drafts + 1 token."""
        return self.num_tokens - (self.num_accepted or 0)


CTX = 1024  # llama.cpp's context: the longest stdlib prompt (~500 tokens) + max_new_tokens


@dataclass(frozen=True)
class LlamaJob:
    """One llama.cpp generation: at most n_tokens after the raw-text prompt (the target's end-of-generation
    tokens stop it earlier), seeded by seed; the target alone, or its speculative mode with a draft."""

    model: Path
    prompt: str
    n_tokens: int
    threads: int
    temperature: float
    seed: int
    draft: Path | None = None  # None: the target alone
    draft_max: int = 8  # draft tokens per step at most

    def command(self, bin_dir: Path) -> list[str]:
        """llama-completion (the target alone) or llama-speculative-simple."""
        t = str(self.threads)
        common = [
            "-m", str(self.model), "-p", self.prompt, "--no-escape",  # verbatim (stdlib docstrings hold "\\n")
            "-c", str(CTX), "-t", t, "-tb", t, "-s", str(self.seed), "--temp", str(self.temperature),
            # temperature is the only sampler: argmax at T = 0, the model's full law at T > 0
            "--samplers", "temperature", "--top-k", "0", "--top-p", "1", "--min-p", "0",
        ]  # fmt: skip
        if self.draft is None:
            n = str(self.n_tokens)
            return [str(bin_dir / "llama-completion"), *common, "-n", n, "-no-cnv", "--no-display-prompt"]
        return [
            str(bin_dir / "llama-speculative-simple"), *common,
            "-n", str(self.n_tokens - 1),  # it stops past -n: at least n_tokens (see llamacpp_row)
            "--spec-type", "draft-simple", "-md", str(self.draft), "--spec-draft-n-max", str(self.draft_max),
            "-td", t, "-tbd", t,
        ]  # fmt: skip


def run_llamacpp(bin_dir: Path, job: LlamaJob, cores: tuple[int, ...] | None = None) -> LlamaRun:
    """Runs job pinned to cores (default: the first job.threads this process may use)."""
    cmd = job.command(bin_dir)
    cores = cores or tuple(sorted(os.sched_getaffinity(0)))[: job.threads]
    out = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    if out.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exited {out.returncode}:\n{out.stderr[-3000:]}")
    if job.draft is None:
        return parse_completion(out.stdout, out.stderr)
    return parse_speculative(out.stdout, out.stderr, job.prompt)


def _number(pattern: str, text: str, kind=float):
    m = re.search(pattern, text)
    if m is None:
        raise ValueError(f"llama.cpp's output has no {pattern!r}")
    return kind(m.group(1))


def parse_completion(stdout: str, stderr: str) -> LlamaRun:
    """llama-completion --no-display-prompt: stdout is the generated text, " [end of text]\n" where an
    end-of-generation token stopped it, then "\n\n"; stderr ends with llama_perf_context_print's timings.
    The last token sampled is never evaluated, so the tokens are the eval runs + 1."""
    text = stdout.removesuffix("\n\n")
    eos = text.endswith(" [end of text]\n")
    text = text.removesuffix(" [end of text]\n")
    prompt_ms = _number(r"prompt eval time =\s*([\d.]+) ms", stderr)
    prompt_tokens = _number(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", stderr, int)
    eval_runs = _number(r":\s+eval time =\s*[\d.]+ ms /\s*(\d+) runs", stderr, int)
    total_ms = _number(r"total time =\s*([\d.]+) ms", stderr)  # from after loading to the end: sampling too
    return LlamaRun(text, eval_runs + 1, prompt_tokens, total_ms / 1e3, (total_ms - prompt_ms) / 1e3, eos)


def parse_speculative(stdout: str, stderr: str, prompt: str) -> LlamaRun:
    """llama-speculative-simple: stdout is "\n\n", the prompt's pieces, the generated text, "\n\n\n\n";
    stderr has "encoded N tokens in S seconds", "decoded ...", n_drafted and n_accept."""
    body = stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    if not body.startswith(prompt):
        raise ValueError("llama-speculative-simple echoed a prompt other than the one given")
    encode_s = _number(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", stderr)
    decode_s = _number(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", stderr)
    return LlamaRun(
        text=body[len(prompt) :],
        num_tokens=_number(r"n_predict\s*=\s*(\d+)", stderr, int),
        prompt_tokens=_number(r"encoded\s+(\d+) tokens", stderr, int),
        wall_s=encode_s + decode_s,
        decode_s=decode_s,
        num_drafted=_number(r"n_drafted\s*=\s*(\d+)", stderr, int),
        num_accepted=_number(r"n_accept\s*=\s*(\d+)", stderr, int),
    )


def llamacpp_version(bin_dir: Path) -> str:
    out = subprocess.run([str(bin_dir / "llama-completion"), "--version"], capture_output=True, text=True)
    return " ".join((out.stdout + out.stderr).split())


# ---------------------------------------------------------------------------------------------
# Rows: one per (system, method, T)


def llamacpp_row(
    method: str, shape: str, t: float, runs: list[LlamaRun], target_runs: list[LlamaRun] | None, max_new_tokens: int
) -> dict:
    """target_runs: llama.cpp's target alone on the same prompts and seeds (what T = 0 must equal; None for
    the target alone's own row).

    llama-speculative-simple's last steps draft without limit (a draft limit of 0 reads as none), so it
    commits up to a draft past max_new_tokens: tokens/s counts max_new_tokens of them over all its time;
    block efficiency and acceptance count every step. At T = 0 its text matches where the target alone's
    is a prefix of it (equal, where an end-of-generation token stopped the target alone)."""
    tokens = sum(min(r.num_tokens, max_new_tokens) for r in runs)
    drafted = sum(r.num_drafted or 0 for r in runs)
    return {
        "system": "llama.cpp",
        "method": method,
        "shape": shape,
        "temperature": t,
        "tokens": tokens,
        "tokens_per_s": round(tokens / sum(r.wall_s for r in runs), 4),
        "decode_tokens_per_s": round(tokens / sum(r.decode_s for r in runs), 4),  # llama.cpp's own figure
        "block_efficiency": round(sum(r.num_tokens for r in runs) / sum(r.num_steps for r in runs), 3),
        "acceptance": round(sum(r.num_accepted or 0 for r in runs) / drafted, 3) if drafted else None,
        "matches_target": None
        if t != 0 or target_runs is None
        else all(_same_text(r, a) for r, a in zip(runs, target_runs, strict=True)),
    }


def _same_text(run: LlamaRun, target: LlamaRun) -> bool:
    return run.text == target.text if target.eos else run.text.startswith(target.text)


def rsd_rows(result: dict) -> list[dict]:
    """rsd's rows from a disaggregated result: its target alone on the whole machine (the cores llama.cpp
    runs on), then each pipeline row (matches_ar: the same tokens as that target alone at T = 0)."""
    from rsd_bench.disaggregated import numeric_label

    whole = result["ar"]["whole_machine"]
    temps = [float(t) for t in whole if t not in ("cores", "dtype", "tokens_per_s_by_dtype")]
    rows = [
        {
            "system": "rsd",
            "method": "target alone",
            "shape": f"{whole['dtype']}{numeric_label(result.get('numeric'))}, cores {whole['cores']}",
            "temperature": t,
            "tokens": whole[str(t)]["tokens"],
            "tokens_per_s": whole[str(t)]["tokens_per_s"],
            "block_efficiency": 1.0,
            "acceptance": None,
            "matches_target": None,
        }
        for t in temps
    ]
    for r in result["rows"]:
        predraft = (
            ""
            if not r["pipelined"]
            else ", pre-drafting" + (f" x{r['predraft_width']}" if r.get("predraft_width", 1) > 1 else "")
        )
        rows.append(
            {
                "system": "rsd",
                "method": r["method"],
                "shape": r["shape"] + predraft,
                "temperature": r["temperature"],
                "tokens": r["tokens"],
                "tokens_per_s": r["tokens_per_s"],
                "block_efficiency": r["block_efficiency"],
                "acceptance": None,
                "matches_target": r["matches_ar"],
            }
        )
    return rows


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row's tokens/s over llama.cpp's target alone (vs_llamacpp_target) and over its own system's
    target alone (vs_own_target), at the same T."""
    base = {(r["system"], r["temperature"]): r["tokens_per_s"] for r in rows if r["method"] == "target alone"}
    for r in rows:
        llama, own = base.get(("llama.cpp", r["temperature"])), base.get((r["system"], r["temperature"]))
        r["vs_llamacpp_target"] = round(r["tokens_per_s"] / llama, 3) if llama else None
        r["vs_own_target"] = round(r["tokens_per_s"] / own, 3) if own else None
    return rows


def cpu_class(flags: list[str]) -> str:
    """The file-name suffix of a machine: its widest matrix or vector feature."""
    return next(
        (name for flag, name in (("amx_bf16", "amx"), ("avx512f", "avx512"), ("avx2", "avx2")) if flag in flags), "cpu"
    )


COLUMNS = (
    "system", "method", "shape", "T", "tokens", "tok/s", "x llama.cpp target alone", "x own target alone",
    "block efficiency", "acceptance", "matches target (T=0)",
)  # fmt: skip


def _cell(value) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def markdown(result: dict) -> str:
    m, ll = result["machine"], result["llamacpp"]
    lines = [
        f"# rsd against llama.cpp on the same GGUF files ({Path(result['target_gguf']).name}, draft "
        f"{Path(result['draft_gguf']).name})",
        "",
        f"{len(result['prompts'])} stdlib prompts (raw text, no chat template) x {result['max_new_tokens']} new "
        f"tokens, {result['threads']} threads, T = {', '.join(f'{t:g}' for t in result['temperatures'])}; seed + i "
        f"for prompt i. CPU: {m['cpu_model']}, flags {' '.join(m['cpu_flags'])}; load {m['loadavg_start']} at the "
        f"start, {result['loadavg_end']} at the end.",
        "",
        f"llama.cpp: {ll['source']}, `{ll['version']}`, built with {' '.join(ll['cmake_flags'])} "
        f"({ll['compiler']}); the target alone is llama-completion, its speculative mode "
        "llama-speculative-simple (a draft chain of at most --spec-draft-n-max tokens; each position keeps the "
        "draft token when the target's sample equals it, so T > 0 follows the target's law), on cores "
        f"{result['llamacpp_cores']}. Both sides read the prompts with the GGUF's vocabulary "
        f"(prompt token counts equal: {_cell(result['prompt_tokens_equal'])}).",
        "",
        "tok/s: all generated tokens over all prompt + generation time (model loading excluded; rsd's through the "
        "gateway). Block efficiency: tokens per target forward. Acceptance: accepted / drafted tokens. Matches "
        "target: at T = 0, the same output as that system's target alone on every prompt. llama.cpp stops at any "
        "of the GGUF's end-of-generation tokens, rsd at its tokenizer's EOS.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "| " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    for r in result["rows"]:
        cells = [r["system"], r["method"], r["shape"], f"{r['temperature']:g}", r["tokens"], r["tokens_per_s"]]
        cells += [r["vs_llamacpp_target"], r["vs_own_target"], r["block_efficiency"], r["acceptance"]]
        matches = "" if r["matches_target"] is None else str(r["matches_target"])
        lines.append("| " + " | ".join(_cell(c) for c in cells) + f" | {matches} |")
    if result.get("rsd") is None:
        lines += ["", "rsd's side did not run (--llamacpp-only)."]
    else:
        lines += ["", *split_table(result["rsd"])]
    return "\n".join(lines) + "\n"


SPLIT = ("draft_ms", "transfer_ms", "queue_ms", "verify_ms", "residual_ms", "step_ms")


def split_table(rsd: dict) -> list[str]:
    """rsd's mean step by part (rsd_bench.disaggregated's split), where the pipeline's time goes."""
    lines = [
        f"rsd's step, mean ms by part (placement: {rsd.get('placement', {})}; the target's forward costs by row "
        "count: `rsd bench forward_cost`):",
        "",
        "| method | shape | T | " + " | ".join(k.removesuffix("_ms") for k in SPLIT) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in SPLIT) + " |",
    ]
    for r in rsd.get("rows", []):
        split = r.get("split") or {}
        cells = [r["method"], r["shape"], f"{r['temperature']:g}", *(_cell(split.get(k)) for k in SPLIT)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


# ---------------------------------------------------------------------------------------------
# The run


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.llamacpp", description=__doc__.split("\n")[0])
    ap.add_argument("--draft", type=Path, help="rsd's draft model folder (holding its .gguf)")
    ap.add_argument("--target", type=Path, help="rsd's target model folder (holding its .gguf)")
    ap.add_argument("--tiny", action="store_true", help="rsd's side on the tiny Qwen2 pair (a smoke run)")
    ap.add_argument("--cache-dir", type=Path, help="rsd's model cache (--tiny, or no --draft/--target)")
    ap.add_argument("--draft-gguf", type=Path, help="default: the .gguf in --draft")
    ap.add_argument("--target-gguf", type=Path, help="default: the .gguf in --target")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads and rsd's target-alone cores")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="prompt i runs with seed + i")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--methods", default="rsd_s:3x4;sd:4", help="rsd's methods, as disaggregated's --methods")
    ap.add_argument("--draft-max", default="4,8", help="llama.cpp's draft lengths, comma-separated: a row each")
    ap.add_argument("--rsd-args", default="", help="more `rsd_bench.disaggregated` flags (placement, --predraft)")
    ap.add_argument("--llamacpp-only", action="store_true", help="skip rsd's side")
    ap.add_argument("--llamacpp-cache", type=Path, help="where llama.cpp is built (default ~/.cache/rsd/llamacpp)")
    ap.add_argument("--name", help="default cpu-vs-llamacpp-<amx|avx512|avx2>")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    return ap


def _gguf(path: Path | None, folder: Path | None, flag: str) -> Path:
    if path is not None:
        return path
    found = sorted(folder.glob("*.gguf")) if folder is not None else []
    if len(found) != 1:
        raise SystemExit(f"error: give --{flag}-gguf (found {len(found)} .gguf files in --{flag} {folder})")
    return found[0]


def llamacpp_runs(bin_dir: Path, target: Path, draft: Path, prompts: list[str], args) -> tuple[list[dict], list]:
    """Every (T, prompt): the target alone, then the speculative mode per draft length (interleaved, so a
    background load hits all alike); -> (rows, the runs as dicts)."""
    temps = [float(t) for t in args.temperatures.split(",")]
    draft_maxes = [int(d) for d in args.draft_max.split(",")]

    def run(prompt: str, n: int, t: float, seed: int, draft_max: int | None = None) -> LlamaRun:
        job = LlamaJob(target, prompt, n, args.threads, t, seed, draft if draft_max else None, draft_max or 0)
        return run_llamacpp(bin_dir, job)

    run(prompts[0], 8, 0.0, 0)  # warm-up: the weights into the page cache
    run(prompts[0], 8, 0.0, 0, draft_maxes[0])
    rows, records = [], []
    for t in temps:
        alone, spec = [], {d: [] for d in draft_maxes}
        for i, prompt in enumerate(prompts):
            alone.append(run(prompt, args.max_new_tokens, t, args.seed + i))
            for d in draft_maxes:
                spec[d].append(run(prompt, args.max_new_tokens, t, args.seed + i, d))
        rows.append(llamacpp_row("target alone", "", t, alone, None, args.max_new_tokens))
        rows += [
            llamacpp_row("speculative", f"draft-max {d}", t, spec[d], alone, args.max_new_tokens) for d in draft_maxes
        ]
        for r in rows[-1 - len(draft_maxes) :]:
            log(f"llama.cpp {r['method']} {r['shape']} T={t:g}: {r['tokens_per_s']} tok/s, BE {r['block_efficiency']}")
        records += [{"method": "target alone", "temperature": t, "prompt": i, **asdict(r)} for i, r in enumerate(alone)]
        records += [
            {"method": "speculative", "draft_max": d, "temperature": t, "prompt": i, **asdict(r)}
            for d in draft_maxes
            for i, r in enumerate(spec[d])
        ]
    return rows, records


def rsd_side(args, out_dir: Path) -> dict:
    """`python -m rsd_bench.disaggregated` on the same prompts, seeds and cores; its result."""
    whole = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    cmd = [
        sys.executable, "-m", "rsd_bench.disaggregated", "--methods", args.methods, "--temperatures",
        args.temperatures, "--num-prompts", str(args.num_prompts), "--prompt-seed", str(args.prompt_seed),
        "--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed),
        "--ar-placements", f"{args.threads - 1};{whole}",  # the target alone on llama.cpp's cores (whole_machine)
        "--out-dir", str(out_dir), "--name", "rsd",
    ]  # fmt: skip
    if args.draft and args.target:
        cmd += ["--draft", str(args.draft), "--target", str(args.target)]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--cache-dir", str(args.cache_dir)] if args.cache_dir else []
    cmd += shlex.split(args.rsd_args)  # last: a flag given here wins
    log(" ".join(shlex.quote(c) for c in cmd))
    subprocess.run(cmd, check=True, stdout=sys.stderr)  # its markdown goes with its progress, to stderr
    return json.loads((out_dir / "rsd.json").read_text())


def prompt_token_counts(args) -> list[int] | None:
    """The prompts' lengths under rsd's target tokenizer (None for --llamacpp-only)."""
    if args.llamacpp_only:
        return None
    from rsd_bench.prompts import stdlib_prompts
    from rsd_runtime.tokenizer import load_tokenizer
    from rsd_tools.launcher import model_dirs

    _, target = model_dirs(args.draft, args.target, args.cache_dir, args.tiny)
    tok = load_tokenizer(target)
    return [len(tok(p["prompt"])["input_ids"]) for p in stdlib_prompts(args.num_prompts, args.prompt_seed)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rsd_bench.machine import machine_info, run_record, write_result
    from rsd_bench.prompts import stdlib_prompts

    target_gguf = _gguf(args.target_gguf, args.target, "target")
    draft_gguf = _gguf(args.draft_gguf, args.draft, "draft")
    machine = machine_info()
    name = args.name or f"cpu-vs-llamacpp-{cpu_class(machine['cpu_flags'])}"
    prompts = [p["prompt"] for p in stdlib_prompts(args.num_prompts, args.prompt_seed)]
    bin_dir = build_llamacpp(args.llamacpp_cache)
    build = json.loads((bin_dir.parent / "build.json").read_text())
    log(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, T {args.temperatures}, {args.threads} threads")

    rows, records = llamacpp_runs(bin_dir, target_gguf, draft_gguf, prompts, args)
    rsd = None
    if not args.llamacpp_only:
        with tempfile.TemporaryDirectory(prefix="rsd-vs-llamacpp-") as tmp:
            rsd = rsd_side(args, Path(tmp))
        rows += rsd_rows(rsd)
    rsd_counts = prompt_token_counts(args)
    llama_counts = [r["prompt_tokens"] for r in records if r["method"] == "target alone"][: len(prompts)]
    result = {
        **run_record("vs_llamacpp"),
        "complete": True,
        "draft_gguf": str(draft_gguf),
        "target_gguf": str(target_gguf),
        "threads": args.threads,
        "llamacpp_cores": sorted(os.sched_getaffinity(0))[: args.threads],
        "temperatures": [float(t) for t in args.temperatures.split(",")],
        "max_new_tokens": args.max_new_tokens,
        "prompts": prompts,
        "prompt_tokens": {"llamacpp": llama_counts, "rsd": rsd_counts},
        "prompt_tokens_equal": None if rsd_counts is None else rsd_counts == llama_counts,
        "machine": machine,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "llamacpp": {**build, "version": llamacpp_version(bin_dir), "runs": records},
        # rsd's disaggregated result as written, less what this file records itself
        "rsd": None if rsd is None else {k: v for k, v in rsd.items() if k not in ("machine", "prompts")},
        "rows": add_ratios(rows),
    }
    write_result(args.out_dir, name, result, markdown(result))
    return 0


def log(msg: str) -> None:
    print(f"[vs_llamacpp] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
