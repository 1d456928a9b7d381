"""The llama.cpp comparison without llama.cpp: its output parsed from real samples (llamacpp_samples/: the
target alone and llama-speculative-simple on the real Q4_K_M pair, one stdlib prompt, T = 0, 64 tokens, 2
threads), the rows, ratios and markdown on made-up runs, the flags, a cached build found without building,
and the whole command (llama.cpp's side) on stand-in binaries that print the samples."""

import json
import stat
import sys
from pathlib import Path

import pytest

from rsd_bench import cli, index, llamacpp
from rsd_bench.llamacpp import LlamaJob, LlamaRun

SAMPLES = Path(__file__).parent / "llamacpp_samples"


def _sample(name: str) -> str:
    return (SAMPLES / name).read_text()


def test_the_target_alone_sample_parses():
    run = llamacpp.parse_completion(_sample("completion.stdout"), _sample("completion.stderr"))
    assert run.text.startswith("    if extra_args is None:\n") and run.text.endswith("if not isinstance(extra_args")
    assert (run.num_tokens, run.prompt_tokens, run.eos) == (64, 152, False)  # 63 eval runs + the last sample
    assert run.wall_s == pytest.approx(19.93817) and run.decode_s == pytest.approx(19.93817 - 5.04986)
    assert run.num_drafted is None and run.num_steps == 64


def test_the_speculative_sample_parses():
    prompt = _sample("prompt.txt")
    run = llamacpp.parse_speculative(_sample("speculative.stdout"), _sample("speculative.stderr"), prompt)
    assert run.text.startswith("    if extra_args is None:\n") and not run.text.startswith(prompt[:20])
    assert (run.num_tokens, run.num_drafted, run.num_accepted, run.num_steps) == (71, 111, 56, 15)
    assert run.prompt_tokens == 152  # both tools read the prompt alike
    assert run.wall_s == pytest.approx(6.682 + 39.860) and run.decode_s == pytest.approx(39.860)
    with pytest.raises(ValueError, match="prompt"):
        llamacpp.parse_speculative(_sample("speculative.stdout"), _sample("speculative.stderr"), "x" + prompt)


def test_an_end_of_generation_token_and_missing_timings_are_seen():
    run = llamacpp.parse_completion("return x [end of text]\n\n\n", _sample("completion.stderr"))
    assert (run.text, run.eos) == ("return x", True)
    with pytest.raises(ValueError, match="eval time"):
        llamacpp.parse_completion("x\n\n", "no timings here")


def test_commands_sample_the_full_law_and_keep_the_prompt_verbatim():
    alone = LlamaJob(Path("t.gguf"), "a\\nb", 64, 2, 1.0, 7).command(Path("b"))
    assert alone[0] == "b/llama-completion" and "--no-escape" in alone and "-no-cnv" in alone
    assert alone[alone.index("-p") + 1] == "a\\nb" and alone[alone.index("-n") + 1] == "64"
    assert alone[alone.index("--samplers") + 1] == "temperature" and alone[alone.index("--min-p") + 1] == "0"
    spec = LlamaJob(Path("t.gguf"), "p", 64, 2, 0.0, 7, Path("d.gguf"), 6).command(Path("b"))
    assert spec[0] == "b/llama-speculative-simple" and spec[spec.index("-md") + 1] == "d.gguf"
    assert spec[spec.index("--spec-draft-n-max") + 1] == "6" and spec[spec.index("-n") + 1] == "63"
    assert spec[spec.index("-t") + 1] == spec[spec.index("-td") + 1] == "2"


def _run(text, tokens, wall, accepted=None, drafted=None, eos=False):
    return LlamaRun(text, tokens, 10, wall, wall * 0.8, eos, drafted, accepted)


def test_llamacpp_rows_count_max_new_tokens_and_match_by_prefix():
    alone = [_run("abc", 8, 2.0), _run("xy", 3, 1.0, eos=True)]
    spec = [_run("abcdef", 11, 1.0, accepted=7, drafted=10), _run("xy", 3, 0.5, accepted=2, drafted=2)]
    row = llamacpp.llamacpp_row("speculative", "draft-max 8", 0.0, spec, alone, 8)
    assert row["tokens"] == 8 + 3 and row["tokens_per_s"] == round(11 / 1.5, 4)  # 3 past max not counted
    assert row["block_efficiency"] == round(14 / 5, 3) and row["acceptance"] == round(9 / 12, 3)
    assert row["matches_target"] is True
    stopped_early = [_run("abc", 8, 2.0), _run("xyz", 4, 0.5, accepted=3, drafted=3)]  # the target stopped at EOS
    assert llamacpp.llamacpp_row("speculative", "", 0.0, stopped_early, alone, 8)["matches_target"] is False
    assert llamacpp.llamacpp_row("speculative", "", 1.0, spec, alone, 8)["matches_target"] is None
    target = llamacpp.llamacpp_row("target alone", "", 0.0, alone, None, 8)
    assert target["block_efficiency"] == 1.0 and target["acceptance"] is None and target["matches_target"] is None


def _disaggregated_result():
    ar = {"cores": "0-1", "dtype": "float32", "0.0": {"tokens_per_s": 5.0, "tokens": 256}}
    ar |= {"1.0": {"tokens_per_s": 4.0, "tokens": 250}, "tokens_per_s_by_dtype": {}}
    row = {"method": "rsd_s", "shape": "3x4", "pipelined": True, "predraft_width": 1, "tokens": 256}
    return {
        "ar": {"same_core": ar, "whole_machine": ar},
        "rows": [
            {**row, "temperature": 0.0, "tokens_per_s": 10.0, "block_efficiency": 3.1, "matches_ar": True},
            {**row, "temperature": 1.0, "tokens_per_s": 6.0, "block_efficiency": 2.0, "matches_ar": None},
        ],
    }


def _rows():
    llama = [
        {"system": "llama.cpp", "method": "target alone", "shape": "", "temperature": t, "tokens_per_s": 8.0}
        for t in (0.0, 1.0)
    ]
    llama += [{"system": "llama.cpp", "method": "speculative", "shape": "draft-max 8", "temperature": 0.0}]
    llama[-1] |= {
        "tokens": 250,
        "tokens_per_s": 12.0,
        "block_efficiency": 3.5,
        "acceptance": 0.5,
        "matches_target": False,
    }
    for r in llama[:2]:
        r |= {"tokens": 256, "block_efficiency": 1.0, "acceptance": None, "matches_target": None}
    return llamacpp.add_ratios(llama + llamacpp.rsd_rows(_disaggregated_result()))


def test_rsd_rows_and_ratios_to_both_targets_alone():
    rows = {(r["system"], r["method"], r["temperature"]): r for r in _rows()}
    assert (
        rows["rsd", "target alone", 1.0]["tokens_per_s"] == 4.0
        and rows["rsd", "target alone", 1.0]["vs_own_target"] == 1
    )
    pipeline = rows["rsd", "rsd_s", 0.0]
    assert pipeline["shape"] == "3x4, pre-drafting" and pipeline["matches_target"] is True
    assert (pipeline["vs_llamacpp_target"], pipeline["vs_own_target"]) == (1.25, 2.0)
    spec = rows["llama.cpp", "speculative", 0.0]
    assert (spec["vs_llamacpp_target"], spec["vs_own_target"]) == (1.5, 1.5)


def test_the_target_numeric_mode_names_rsds_target_alone():
    """--rsd-args '--numeric q8_activations': the row says the target ran in that mode (exact: nothing added)."""
    exact = llamacpp.rsd_rows(_disaggregated_result())[0]["shape"]
    q8 = llamacpp.rsd_rows({**_disaggregated_result(), "numeric": "q8_activations"})[0]["shape"]
    assert "numeric" not in exact and q8.startswith(exact.split(",")[0] + ", numeric q8_activations, cores")


def _result(rows, rsd=True):
    machine = {"cpu_model": "AMD EPYC", "cpu_flags": ["avx2", "fma", "avx512f"], "loadavg_start": [1.0]}
    build = {"source": "llama-cpp-python==0.3.36", "cmake_flags": ["-DGGML_NATIVE=ON"], "compiler": "gcc"}
    return {
        "benchmark": "vs_llamacpp",
        "target_gguf": "/m/t.gguf",
        "draft_gguf": "/m/d.gguf",
        "prompts": ["a", "b"],
        "max_new_tokens": 64,
        "threads": 2,
        "temperatures": [0.0, 1.0],
        "machine": machine,
        "loadavg_end": [1.0],
        "llamacpp": {**build, "version": "version: 0.5.0-dev"},
        "llamacpp_cores": [0, 1],
        "prompt_tokens_equal": True,
        "rsd": {} if rsd else None,
        "rows": rows,
    }


def test_markdown_has_a_row_per_system_method_and_t():
    text = llamacpp.markdown(_result(_rows()))
    assert "| llama.cpp | speculative | draft-max 8 | 0 | 250 | 12.00 | 1.50 | 1.50 | 3.50 | 0.50 | False |" in text
    assert "| rsd | rsd_s | 3x4, pre-drafting | 0 | 256 | 10.00 | 1.25 | 2.00 | 3.10 | - | True |" in text
    assert "prompt token counts equal: True" in text and "-DGGML_NATIVE=ON" in text
    assert "did not run" in llamacpp.markdown(_result(_rows(), rsd=False))
    headline = index.headline(_result(_rows()))
    assert headline.startswith("rsd 1.25x llama.cpp's target alone (rsd_s 3x4, pre-drafting, T=0)")


def test_flags_and_registration():
    args = llamacpp.build_parser().parse_args(["--target", "t", "--draft", "d", "--draft-max", "6"])
    assert (args.threads, args.num_prompts, args.max_new_tokens, args.temperatures) == (2, 4, 64, "0,1")
    assert args.draft_max == "6" and not args.llamacpp_only and args.methods == "rsd_s:3x4;sd:4"
    assert cli.BENCHMARKS["vs_llamacpp"][0] == "rsd_bench.llamacpp"
    assert [llamacpp.cpu_class(f) for f in (["avx2"], ["avx2", "avx512f"], ["avx512f", "amx_bf16"], [])] == [
        "avx2",
        "avx512",
        "amx",
        "cpu",
    ]


def test_a_gguf_is_found_in_its_model_folder(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    assert llamacpp._gguf(None, tmp_path, "target") == tmp_path / "m.gguf"
    assert llamacpp._gguf(Path("x.gguf"), tmp_path, "target") == Path("x.gguf")
    with pytest.raises(SystemExit, match="--draft-gguf"):
        llamacpp._gguf(None, tmp_path / "none", "draft")


# Stand-ins for the two tools: print the samples, the speculative one echoing the prompt it was given.
STAND_IN = """#!{python}
import sys
from pathlib import Path
samples, argv = Path({samples!r}), sys.argv[1:]
if "--version" in argv:
    print("version: 0 (stand-in)")
    raise SystemExit
name = "{name}"
out = samples.joinpath(name + ".stdout").read_text()
if name == "speculative":
    out = out.replace(samples.joinpath("prompt.txt").read_text(), argv[argv.index("-p") + 1], 1)
sys.stdout.write(out)
sys.stderr.write(samples.joinpath(name + ".stderr").read_text())
"""


def test_a_cached_build_is_reused_and_the_command_runs_on_stand_ins(tmp_path):
    bin_dir = tmp_path / "cache" / llamacpp.LLAMACPP_PYTHON_VERSION / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir.parent / "build.json").write_text(json.dumps({"source": "stand-in", "cmake_flags": [], "compiler": "-"}))
    for tool, name in zip(llamacpp.TOOLS, ("completion", "speculative"), strict=True):
        (bin_dir / tool).write_text(STAND_IN.format(python=sys.executable, samples=str(SAMPLES), name=name))
        (bin_dir / tool).chmod((bin_dir / tool).stat().st_mode | stat.S_IEXEC)
    assert llamacpp.build_llamacpp(tmp_path / "cache") == bin_dir  # nothing downloaded, nothing built

    argv = ["--llamacpp-only", "--llamacpp-cache", str(tmp_path / "cache"), "--num-prompts", "2", "--threads", "1"]
    argv += ["--target-gguf", "t.gguf", "--draft-gguf", "d.gguf", "--draft-max", "4,8", "--out-dir", str(tmp_path)]
    assert llamacpp.main([*argv, "--name", "r"]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["benchmark"] == "vs_llamacpp" and result["machine"]["cpu_flags"] is not None
    assert [(r["method"], r["shape"], r["temperature"]) for r in result["rows"]] == [
        (method, shape, t)
        for t in (0.0, 1.0)
        for method, shape in (("target alone", ""), ("speculative", "draft-max 4"), ("speculative", "draft-max 8"))
    ]
    spec = result["rows"][1]
    assert spec["tokens"] == 2 * 64 and spec["block_efficiency"] == round(71 / 15, 3)
    assert spec["matches_target"] is False  # the sample: its text leaves the target alone's (not batch-invariant)
    assert result["prompt_tokens_equal"] is None and result["rsd"] is None
    assert len(result["llamacpp"]["runs"]) == 2 * 2 * 3 and (tmp_path / "r.md").is_file()
