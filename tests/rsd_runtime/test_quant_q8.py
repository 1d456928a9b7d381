"""The opt-in numeric mode "q8_activations" (rsd_runtime.quant_q8, csrc/quant_gemm_q8.c): its kernel equals the
numpy reference bit for bit (each row quantised as ggml's reference code does, integer block sums, the float
scaling in one order) for every type, build and row count; a row's bits are its own whatever its batch; a GGUF
model in this mode keeps tree rows equal to one-token rows, so speculative greedy output is the target's alone;
what cannot run it is refused with the reason."""

import numpy as np
import pytest
import torch

import tests.rsd_runtime.test_batch_invariance as invariance
from rsd.methods import Method
from rsd.sampling import SamplingParams
from rsd_runtime import quant, quant_q8
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.lean import lean_decoder
from rsd_runtime.models import batch_variance, load_model, prepare_draft
from rsd_runtime.runner import ModelRunner
from rsd_tools.tiny import build_tiny_gguf_pair, build_tiny_pair
from tests.rsd_runtime.test_generator import PROMPTS, target_greedy
from tests.rsd_runtime.test_quant import TYPES, every_build, k_for, random_blocks

needs_kernel = pytest.mark.skipif(quant_q8.kernel_name() is None, reason=quant_q8.unavailable_reason())
build = every_build(quant_q8)


def inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Random rows with the cases quantisation must get right: a zero block, a row whose largest magnitude is
    negative and repeated with both signs (the first one sets the scale), values on half-way points."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :32] = 0
    if rows > 1:
        x[1, 5], x[1, 9] = -40.0, 40.0
    if rows > 2:
        x[2] = torch.arange(k) % 255 - 127.0  # scale 1: codes on the integers, halves below
        x[2, 1::7] += 0.5
    return x


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n", [37, 40])  # 37: columns past the blocks of 4; 40: repacked 8 rows a block (x8)
def test_kernel_is_the_reference_bit_for_bit(build, type_name, n):
    qtype, k = TYPES[type_name], k_for(type_name)
    blocks = random_blocks(type_name, n, k, seed=4)
    bias = torch.randn(n)
    layer = quant_q8.Q8ActivationLinear(blocks, qtype, k, n, bias)
    assert ("blocks_x8" in dict(layer.named_buffers())) == (n == 40 and qtype in quant_q8.X8_BYTES)
    assert torch.equal(layer.file_blocks(), blocks)  # the repacked layout gives the file's bytes back
    for rows in (1, 2, 3, 4, 5, 7, 64):  # 1: the K-quants decoded in registers; x8: rows 4 at a time
        x = inputs(rows, k, rows)
        codes = quant_q8.quantize_rows(x, qtype)
        for ours, ref in zip(codes, quant_q8.quantize_reference(x.numpy(), qtype), strict=True):
            assert np.array_equal(ours.numpy(), ref), rows
        assert torch.equal(layer(x), quant_q8.reference(x, blocks, qtype, k) + bias), rows


@pytest.mark.parametrize("type_name", TYPES)
def test_the_reference_reads_the_weights_as_dequantize(type_name):
    """The reference's codes and scales rebuild gguf-py's dequantised weight bit for bit (ggml's formulas)."""
    qtype, k = TYPES[type_name], k_for(type_name)
    blocks = random_blocks(type_name, 9, k, seed=5)
    w, be = quant_q8.weight_codes(blocks.numpy(), qtype, k), quant.KERNEL_TYPES[qtype][1]
    d = np.repeat(w["d"], be, axis=-1)
    if type_name == "Q4_K":
        rebuilt = (d * w["sc"]) * w["q"] - np.repeat(w["dmin"], be, axis=-1) * w["m"]
    elif type_name == "Q6_K":
        rebuilt = (d * w["sc"]) * w["q"]
    else:
        rebuilt = w["q"] * d
    assert np.array_equal(rebuilt.astype(np.float32), quant.dequantize(blocks, qtype, k).numpy())


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n", [300, 304])  # 304: repacked (x8)
def test_a_rows_bits_do_not_depend_on_its_batch(build, type_name, n):
    k = k_for(type_name)
    layer = quant_q8.Q8ActivationLinear(random_blocks(type_name, n, k), TYPES[type_name], k, n)
    x = inputs(70, k, 1)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(70)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (2, 13, 64, 70):
                assert torch.equal(layer(x[:rows]), alone[:rows]), (t, rows)
    finally:
        torch.set_num_threads(threads)


def test_fused_layers_compute_each_column_as_alone(build):
    """The lean decoder's one call for q/k/v or gate/up (Q8ActivationLinear.fuse): each column's bits as in its own
    layer, the parts still computing from views of the fused blocks; parts of different types are not fused, nor a
    part with an odd group of 8 rows before another (its group would pair across the parts: quant_q8._pair_groups)."""
    k = k_for("Q4_K")
    parts = [
        quant_q8.Q8ActivationLinear(random_blocks("Q4_K", n, k, seed=i), TYPES["Q4_K"], k, n, torch.randn(n))
        for i, n in enumerate((16, 32, 24))
    ]
    x = inputs(5, k, 3)
    alone = torch.cat([p(x) for p in parts], dim=-1)
    fused = quant_q8.Q8ActivationLinear.fuse(parts)
    assert torch.equal(fused(x), alone) and torch.equal(torch.cat([p(x) for p in parts], dim=-1), alone)
    other = quant_q8.Q8ActivationLinear(random_blocks("Q6_K", 8, k), TYPES["Q6_K"], k, 8, torch.randn(8))
    assert quant_q8.Q8ActivationLinear.fuse([parts[0], other]) is None
    assert quant_q8.Q8ActivationLinear.fuse([parts[2], parts[0]]) is None


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    return build_tiny_gguf_pair(tmp_path_factory.mktemp("gguf"), "qwen2")


@needs_kernel
def test_a_model_in_this_mode_speculates_exactly(gguf_pair):
    """Every quantised layer computes with int8 activations (another function: the logits move off the exact
    mode's), tree rows are the one-token rows bit for bit, and speculative greedy output is the target's own."""
    draft_dir, target_dir = gguf_pair
    target = load_model(target_dir, numeric="q8-activations")
    assert target.rsd_numeric == "q8_activations" and batch_variance(target) == ""
    assert lean_decoder(target) is not None  # the mode's decoder is the lean one (rsd_runtime.lean), rows their own
    layers = [m for m in target.modules() if isinstance(m, quant.QuantLinear)]
    assert layers and all(isinstance(m, quant_q8.Q8ActivationLinear) for m in layers)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():  # the model's own forward, layers in int8 activations
        ours, exact = target(ids).logits, load_model(target_dir)(ids).logits
    assert not torch.equal(ours, exact)
    assert (ours - exact).abs().max() < 0.05 * exact.abs().max()  # int8 inputs: near, not equal
    with torch.no_grad(), quant_q8.exact_layers(target):  # the load-time tree probe's exact computation
        assert torch.equal(target(ids).logits, exact)
    invariance.test_a_tree_row_is_the_one_token_step_bit_for_bit(target)
    draft = load_model(draft_dir, numeric="q8_activations")  # any known draft law is fine: this one too
    prepare_draft(draft, draft_vocab=100)  # its pruned GGUF head keeps the mode
    assert isinstance(draft.get_output_embeddings().kept, quant_q8.Q8ActivationLinear)
    gen = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256))
    for name, shape in (("sd", "4"), ("rsd_s", "3x4")):
        for prompt in PROMPTS:
            out = gen.generate(prompt, Method.parse(name, shape), SamplingParams(temperature=0), max_new_tokens=12)
            assert out.token_ids == target_greedy(target, prompt, 12), (name, prompt)


def test_refusals(gguf_pair, tmp_path):
    _, target_dir = gguf_pair
    with pytest.raises(ValueError, match="numeric must be one of"):
        load_model(target_dir, numeric="int4")
    with pytest.raises(ValueError, match="dequantised weights cannot reproduce"):
        load_model(target_dir, device="cuda", numeric="q8_activations")  # refused before any device is touched
    with pytest.raises(ValueError, match="dequantised weights cannot reproduce"):
        load_model(target_dir, dtype="bfloat16", numeric="q8_activations")
    _, plain_dir = build_tiny_pair(tmp_path, "qwen2", hidden_size=64, num_layers=1, draft_layers=1)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(plain_dir, numeric="q8_activations")
    from verifier_service.config import VerifierConfig

    with pytest.raises(ValueError, match="numeric"):
        VerifierConfig(numeric="fast")
