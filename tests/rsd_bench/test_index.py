"""benchmarks/results/INDEX.md is what rsd_bench.index writes now, every current run has its companions, and
nothing superseded stays current; the index's rules on small made-up folders; `rsd bench NAME` reaches it."""

import json

import pytest

import rsd_cli
from rsd_bench import index
from rsd_tools import cli as tools_cli
from rsd_tools.defaults import RESULTS_DIR

AMX = {"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_flags": ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"]}
ZEN4 = {"cpu_model": "AMD EPYC", "cpu_flags": ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"]}


def test_the_index_is_current():
    assert (RESULTS_DIR / index.INDEX).read_text() == index.render(RESULTS_DIR), "stale: run `rsd bench index`"


def test_the_results_folder_holds_only_current_runs_with_their_files():
    assert index.problems(RESULTS_DIR) == []
    for run in index.read_runs(RESULTS_DIR):
        assert {f"{run.name}.json", f"{run.name}.md"} <= set(run.files)
        assert run.benchmark in index.HEADLINES and run.date != "-" and run.commit != "-"


def test_machine_classes_follow_the_recorded_flags():
    assert index.machine_class({"machine": AMX}) == "Intel Xeon, AMX"
    assert index.machine_class({"machine": ZEN4}) == "AMD EPYC, AVX512-BF16"
    assert index.machine_class({"machine": {"cpu_model": "AMD EPYC", "cpu_flags": ["avx2", "fma"]}}) == "AMD EPYC, AVX2"
    assert index.machine_class({"host": {"cpu_model": "AMD EPYC"}}) == "AMD EPYC, CPU flags not recorded"
    assert index.machine_class({"setup": {"cpu": ZEN4}}) == "AMD EPYC, AVX512-BF16"  # the load test's record
    assert index.machine_class({"machine": {**AMX, "device_name": "NVIDIA H200"}}) == "GPU: NVIDIA H200"
    assert index.machine_class({}) == "CPU not recorded"


def _run(folder, name, date, machine=AMX, rows=None, **extra):
    rows = rows if rows is not None else [{"method": "ar", "label": "ar", "temperature": 0.0, "speedup_vs_ar": 1.0}]
    record = {"benchmark": "methods", "date": date, "commit": "abc1234def", "machine": machine, "rows": rows}
    (folder / f"{name}.json").write_text(json.dumps({**record, **extra}))
    (folder / f"{name}.md").write_text(f"# {name}\n")


def test_an_older_run_of_the_same_benchmark_and_class_is_archived(tmp_path):
    sd = [{"method": "sd", "label": "sd:4", "temperature": 1.0, "speedup_vs_ar": 1.25}]
    _run(tmp_path, "old", "2026-12-01T00:00:00+00:00")
    (tmp_path / "old-tokens-per-s.png").write_bytes(b"png")
    _run(tmp_path, "new", "2026-12-02T00:00:00+00:00", rows=sd)
    _run(tmp_path, "other-machine", "2026-11-01T00:00:00+00:00", machine=ZEN4, rows=[], complete=False)
    (tmp_path / "notes.md").write_text("# a report\n")
    assert index.problems(tmp_path) == ["old is superseded: rsd bench index --archive"]
    assert index.main(["--results-dir", str(tmp_path), "--archive"]) == 0
    assert sorted(p.name for p in (tmp_path / "archive").iterdir()) == ["old-tokens-per-s.png", "old.json", "old.md"]
    assert index.problems(tmp_path) == [] and index.main(["--results-dir", str(tmp_path), "--check"]) == 0
    text = (tmp_path / "INDEX.md").read_text()
    assert "| methods | Intel Xeon, AMX | 2026-12-02 | abc1234 | 1.25x the target alone: sd:4, T=1 |" in text
    assert "| methods | AMD EPYC, AVX512-BF16 | 2026-11-01 | abc1234 | - |" in text  # no figure: none invented
    assert "[notes.md](notes.md)" in text and "[tokens-per-s](archive/old-tokens-per-s.png)" in text


def test_a_tie_for_the_latest_is_left_to_a_person_and_strays_are_named(tmp_path):
    _run(tmp_path, "a", "2026-12-01T00:00:00+00:00")
    _run(tmp_path, "b", "2026-12-01T00:00:00+00:00")
    (tmp_path / "c-tokens-per-s.png").write_bytes(b"png")
    issues = index.problems(tmp_path)
    assert "c-tokens-per-s.png: belongs to no run" in issues and any("share the latest date" in i for i in issues)
    with pytest.raises(SystemExit, match="share the latest date"):
        index.main(["--results-dir", str(tmp_path), "--archive"])
    assert index.main(["--results-dir", str(tmp_path), "--check"]) == 1


def test_rsd_bench_reaches_the_benchmarks_by_name_and_the_tools_do_not(tmp_path, capsys):
    _run(tmp_path, "a", "2026-12-01T00:00:00+00:00")
    assert rsd_cli.main(["bench", "index", "--results-dir", str(tmp_path)]) == 0
    assert rsd_cli.main(["bench", "index", "--results-dir", str(tmp_path), "--check"]) == 0
    with pytest.raises(SystemExit):
        rsd_cli.main(["bench", "no-such-benchmark"])
    with pytest.raises(SystemExit):
        tools_cli.main(["bench", "index"])  # rsd_tools alone has no bench: rsd_cli adds it
    capsys.readouterr()
