"""A cheap drafter: int8 dynamic quantisation of the draft model (rsd_runtime.models.quantize_draft).

The drafter's law only has to be known to the verifier, not equal to anything, so a quantised drafter
keeps speculative decoding exact: greedy output stays the target's own, the T > 0 law stays the
target's (chi-square), and the drafter service serves it over real gRPC. The options that change the
drafter compose in one order (prune, quantise, small-batch linear) and the wrong uses are refused.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear  # its repr: DynamicQuantizedLinear

from drafter_service import server as drafter_server
from drafter_service.config import DrafterConfig
from rsd.methods import Method
from rsd.sampling import SamplingParams
from rsd_runtime import models, small_gemm
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.linear import Int8Linear, use_small_batch_linear
from rsd_runtime.models import int8_auto, int8_speedup, load_model, prune_draft_vocab, quantize_draft
from rsd_runtime.runner import ModelRunner
from rsd_tools.tiny import build_tiny_pair, build_tiny_vocab_pair
from rsd_wire import GRPC_OPTIONS, drafter_pb2_grpc
from tests.fixtures.load import busy_cores
from tests.fixtures.services import MAX_LEN, PROMPT, gen_params, run, services
from tests.fixtures.toy import chi_square_pvalue
from tests.rsd_runtime.test_generator import PROMPTS, target_greedy, target_law_two_tokens
from verifier_service import server as verifier_server
from verifier_service.config import VerifierConfig

# The int8 layer quantize_draft gives here: Int8Linear where small_gemm's AVX512-VNNI kernel runs (the tiny
# models' layer widths are multiples of 64), fbgemm's dynamic layer elsewhere (AVX2, RSD_SMALL_GEMM=avx2 or 0).
INT8_LAYER = Int8Linear if small_gemm.available(torch.int8) else DynamicLinear


def num_int8_layers(model: torch.nn.Module) -> int:
    """int8 layers of either kind: Int8Linear (AVX512-VNNI kernel) or torch's dynamic ones (fbgemm)."""
    return sum(isinstance(m, (Int8Linear, DynamicLinear)) for m in model.modules())


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"), "qwen2")


@pytest.fixture(scope="module")
def int8_pair(tiny_dirs):
    draft_dir, target_dir = tiny_dirs
    draft = load_model(draft_dir)
    assert quantize_draft(draft, "int8") == "int8"
    return draft, load_model(target_dir)


def test_int8_replaces_every_linear_and_changes_the_draft_law(tiny_dirs, int8_pair):
    draft, _ = int8_pair
    plain = load_model(tiny_dirs[0])
    linears = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    assert sum(type(m) is INT8_LAYER for m in draft.modules()) == num_int8_layers(draft) == linears
    assert not any(isinstance(m, torch.nn.Linear) for m in draft.modules())
    ids = torch.tensor([PROMPTS[2]])
    with torch.inference_mode():
        diff = (draft(ids).logits - plain(ids).logits).abs().max()
    assert 1e-4 < diff < 1.0  # a different law (int8 rounding), close to the float one


@pytest.mark.parametrize(("name", "shape"), [("sd", "4"), ("rsd_c", "2,2,1"), ("spectr", "2x3"), ("rsd_s", "3x4")])
def test_int8_drafter_keeps_greedy_output(int8_pair, name, shape):
    draft, target = int8_pair
    gen = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256))
    for prompt in PROMPTS:
        out = gen.generate(prompt, Method.parse(name, shape), SamplingParams(0), max_new_tokens=16)
        assert out.token_ids == target_greedy(target, prompt, 16)


@pytest.mark.parametrize(
    ("name", "shape", "params"),
    [
        ("rsd_s", "3x2", SamplingParams(temperature=1.0)),
        ("rsd_c", "2,2", SamplingParams(temperature=0.7, top_k=6)),
    ],
)
def test_int8_drafter_law_follows_target(tmp_path, name, shape, params):
    draft_dir, target_dir = build_tiny_vocab_pair(tmp_path, vocab_size=8)
    draft, target = load_model(draft_dir), load_model(target_dir)
    assert quantize_draft(draft, "int8") == "int8"
    gen = SpeculativeGenerator(ModelRunner(target, 64), ModelRunner(draft, 64))
    prompt, n, counts = [2, 5, 6], 1500, {}
    for seed in range(n):
        out = gen.generate(prompt, Method.parse(name, shape), params, max_new_tokens=2, seed=seed)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert chi_square_pvalue(counts, target_law_two_tokens(target, prompt, params), n) > 1e-4


def test_options_compose_in_order_or_are_refused(tiny_dirs):
    """prune -> int8 (the pruned head is quantised and still scores only its ids) -> small-batch
    linear (patches no int8 layer); the other orders and int8 where it cannot run are refused."""
    draft_dir, target_dir = tiny_dirs
    draft, target = load_model(draft_dir), load_model(target_dir)
    prune_draft_vocab(draft, 100)
    assert quantize_draft(draft, "int8") == "int8"
    assert isinstance(draft.get_output_embeddings().kept, INT8_LAYER)
    assert use_small_batch_linear(draft) == 0  # nothing left to patch: every linear layer is int8
    runner = ModelRunner(draft, 256)
    logits = runner.forward(torch.tensor(PROMPTS[0]), torch.arange(-1, len(PROMPTS[0]) - 1))
    assert torch.isinf(logits[:, 100:]).all() and torch.isfinite(logits[:, :100]).all()
    gen = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256))
    out = gen.generate(PROMPTS[1], Method.parse("rsd_s", "3x3"), SamplingParams(0), max_new_tokens=10)
    assert out.token_ids == target_greedy(target, PROMPTS[1], 10)

    with pytest.raises(ValueError, match="before quantising"):
        prune_draft_vocab(draft, 50)
    with pytest.raises(ValueError, match="quantised already"):
        quantize_draft(draft, "int8")
    patched = load_model(draft_dir, small_batch_rows=64)  # the float layers' patch goes with them
    assert quantize_draft(patched, "int8") == "int8"
    assert not any(hasattr(m, "small_batch_rows") for m in patched.modules())
    with pytest.raises(ValueError, match="must be one of"):
        quantize_draft(load_model(draft_dir), "int4")
    with pytest.raises(ValueError, match="float32 activations"):
        quantize_draft(load_model(draft_dir, dtype="bfloat16"), "int8", "bfloat16")
    assert quantize_draft(load_model(draft_dir, dtype="bfloat16"), "auto", "bfloat16") == "none"
    with pytest.raises(ValueError, match="float32 activations"):
        DrafterConfig(quantize="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="CPU only"):
        DrafterConfig(quantize="int8", device="cuda:0")
    with pytest.raises(ValueError, match="quantize"):
        DrafterConfig(quantize="fp8")


def test_auto_decides_by_the_machine_and_the_model_never_by_a_timing(tiny_dirs, monkeypatch):
    """auto takes int8 exactly where int8_auto says so: the VNNI kernel takes every layer and the float32
    weights reach INT8_AUTO_MIN_BYTES. The same answer with every core busy (a timing once flipped it under
    load, and a seeded run's tokens with it); either way the result is a valid drafter."""
    idle = int8_auto(load_model(tiny_dirs[0]))
    assert idle.startswith("none")  # the tiny drafter is far below the size where int8 pays
    with busy_cores(max_s=60):
        assert int8_auto(load_model(tiny_dirs[0])) == idle
    monkeypatch.setattr(models, "INT8_AUTO_MIN_BYTES", 0)
    model = load_model(tiny_dirs[0])
    vnni = all(Int8Linear.takes(m) for m in model.modules() if isinstance(m, torch.nn.Linear))
    applied = quantize_draft(model, "auto")
    assert applied == ("int8" if vnni else "none") and (num_int8_layers(model) > 0) == (applied == "int8")
    assert int8_speedup(load_model(tiny_dirs[0])) > 0  # still measured, for the benchmarks to report


def test_drafter_service_serves_an_int8_drafter(tiny_dirs, int8_pair):
    """python -m drafter_service --quantize int8, in-process on port 0: the server loads and quantises
    its own model; through real gRPC T=0 is the target's greedy output and T>0 equals the in-process
    run with an int8 drafter, token for token."""
    draft_dir, _ = tiny_dirs
    draft, target = int8_pair
    greedy = target_greedy(target, PROMPT, 16)
    method, sampling = Method.parse("rsd_s", "3x3"), SamplingParams(0.8)
    gen = SpeculativeGenerator(ModelRunner(target, MAX_LEN), ModelRunner(draft, MAX_LEN), draft_top_k=256)
    sampled = gen.generate(PROMPT, method, sampling, max_new_tokens=16, seed=7).token_ids

    async def main():
        config = DrafterConfig(max_len=MAX_LEN, model=str(draft_dir), quantize="int8")
        vserver, _, vhandle = await verifier_server.create_server(VerifierConfig(max_len=MAX_LEN), target)
        dserver, _, dhandle = await drafter_server.create_server(config)
        try:
            assert dhandle.quantize == "int8" and num_int8_layers(dhandle.engine.model) > 0
            async with grpc.aio.insecure_channel(dhandle.address, options=GRPC_OPTIONS) as chan:
                stub = drafter_pb2_grpc.DrafterStub(chan)
                tokens0, _ = await run(stub, vhandle, "q-greedy", gen_params("rsd_s", "3x3", 0.0, 1), new_tokens=16)
                tokens1, _ = await run(stub, vhandle, "q-sample", gen_params("rsd_s", "3x3", 0.8, 7), new_tokens=16)
        finally:
            await dhandle.close(dserver, 0)
            await vhandle.close(vserver, 0)
        assert tokens0 == greedy
        assert tokens1 == sampled

    asyncio.run(main())


def test_services_helper_still_takes_a_given_model(int8_pair):
    """A model handed to create_server is used as given (tests share one): quantize applies only to a
    model the server loads itself."""
    draft, target = int8_pair

    async def main():
        async with services((draft, target), drafter_cfg={"quantize": "none"}) as (_, dhandle, _, _):
            assert dhandle.quantize == "none" and num_int8_layers(dhandle.engine.model) > 0

    asyncio.run(main())


def test_bench_compares_drafters_in_one_run(tiny_dirs, tmp_path):
    """rsd bench methods --draft-quantize none,int8,auto: every speculative method runs once per drafter (labels
    +int8, +auto, rows say what was applied), each drafter's forward is timed by tokens, greedy rows
    still equal ar, and the placement and CPU flags are recorded; --costs-only stops after the timings."""
    import json

    from rsd_bench.methods import cli as bench

    draft_dir, target_dir = tiny_dirs
    argv = ["--draft", str(draft_dir), "--target", str(target_dir), "--out-dir", str(tmp_path), "--no-plots"]
    argv += ["--draft-quantize", "none,int8,auto", "--draft-cost-tokens", "1,3", "--cost-reps", "1"]
    assert bench.main([*argv, "--config", "ar;sd:2", "--num-prompts", "1", "--max-new-tokens", "6",
                       "--temperatures", "0", "--threads", "1", "--name", "q"]) == 0  # fmt: skip
    result = json.loads((tmp_path / "q.json").read_text())
    rows = {r["label"]: r for r in result["rows"]}
    assert set(rows) == {"ar", "sd:2", "sd:2+int8", "sd:2+auto"}
    assert (rows["sd:2"]["draft_quantize"], rows["sd:2+int8"]["draft_quantize"]) == ("none", "int8")
    assert rows["sd:2+auto"]["draft_quantize"] == result["settings"]["draft_quantize"]["auto"]
    assert all(r["matches_ar"] for r in rows.values())
    assert set(result["forward_costs"]["draft_ms_by_tokens"]["int8"]) == {"1", "3"}
    assert set(result["forward_costs"]["c_by_draft"]) == {"none", "int8", "auto"}
    assert result["machine"]["placement"]["threads"] == 1 and "cpu_flags" in result["machine"]
    assert bench.main([*argv, "--costs-only", "--num-prompts", "1", "--name", "c"]) == 0
    costs_only = json.loads((tmp_path / "c.json").read_text())
    assert costs_only["rows"] == [] and costs_only["complete"]
    assert set(costs_only["forward_costs"]["draft_ms_by_tokens"]) == {"none", "int8", "auto"}


def test_int8_takes_the_vnni_kernel_where_it_runs_else_fbgemm(tiny_dirs, monkeypatch):
    draft = load_model(tiny_dirs[0])
    quantize_draft(draft, "int8")
    assert {type(m) for m in draft.modules()} & {Int8Linear, DynamicLinear} == {INT8_LAYER}
    monkeypatch.setattr(Int8Linear, "takes", staticmethod(lambda linear: False))  # a CPU without VNNI
    draft = load_model(tiny_dirs[0])
    quantize_draft(draft, "int8")
    assert {type(m) for m in draft.modules()} & {Int8Linear, DynamicLinear} == {DynamicLinear}


@pytest.mark.skipif(not small_gemm.available(torch.int8), reason="no AVX512-VNNI CPU")
def test_int8_linear_is_close_to_float_and_a_row_is_the_same_in_any_batch():
    """Per-row activation scales: a row's output does not depend on its batch-mates (nor on the chunking
    of more than MAX_ROWS rows), and stays within int8 rounding of the float layer."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(192, 300)
    layer = Int8Linear(linear)
    x = torch.randn(small_gemm.MAX_ROWS + 7, 192)
    x[3] *= 50  # a row of another scale must not change the others
    with torch.inference_mode():
        y = layer(x)
        ref = linear(x)
        for r in (0, 3, 5, small_gemm.MAX_ROWS + 2):
            assert torch.equal(layer(x[r : r + 1])[0], y[r])
        assert torch.equal(layer(x[None, :5])[0], y[:5])  # any leading shape
    err = (y - ref).abs().amax(dim=1) / ref.abs().amax(dim=1)
    assert err.max() < 0.05
    with pytest.raises(ValueError, match="rows"):  # the kernel's call takes at most MAX_ROWS: the layer splits
        small_gemm.int8_linear(x, layer.weight_int8, layer.w_scale, layer.w_shift, layer.bias)
