"""GGUF models served from their own blocks (rsd_runtime.gguf_model, rsd_runtime.quant), on tiny pairs the
tests write themselves (rsd_tools.gguf_export): the file's model is the model served, exactly.

- Tensor names and the Llama q/k row order: an all-F32 file gives the checkpoint's own logits.
- A target of every type (Q4_K, Q5_0, Q6_K, Q8_0, F16, BF16, F32): its quantised layers are the dequantised
  weights (what transformers' GGUF loading and the dequantise-on-load path serve), its logits theirs to float
  rounding; a tree row equals the one-token step bit for bit; every method's greedy output is the target's;
  sampling follows the target's law (chi-square on an enumerable vocabulary).
- Other devices and dtypes dequantise on load; what cannot be served is refused with the reason."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import tests.rsd_runtime.test_batch_invariance as invariance
from rsd.methods import Method
from rsd.sampling import SamplingParams
from rsd_runtime import quant
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.gguf_model import gguf_config, gguf_file, load_gguf
from rsd_runtime.lean import lean_decoder, use_lean_forward
from rsd_runtime.models import batch_variance, int8_speedup, int8_unsupported, load_model, prepare_draft
from rsd_runtime.runner import ModelRunner
from rsd_tools.gguf_export import write_gguf
from rsd_tools.tiny import build_tiny_gguf_pair, build_tiny_pair
from tests.fixtures.toy import chi_square_pvalue
from tests.rsd_runtime.test_generator import GREEDY_METHODS, PROMPTS, target_greedy, target_law_two_tokens

needs_kernel = pytest.mark.skipif(
    quant.kernel_name() is None, reason=f"no quantised kernel: {quant.unavailable_reason()}"
)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def gguf_pair(request, tmp_path_factory):
    return build_tiny_gguf_pair(tmp_path_factory.mktemp("gguf"), request.param)


@torch.no_grad()
def assert_same_logits(a, b, tol: float) -> None:
    ids = torch.tensor([PROMPTS[2]])
    torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=tol, atol=tol)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_an_f32_file_is_the_checkpoint(tmp_path, family):
    _, target_dir = build_tiny_pair(tmp_path, family, hidden_size=256, num_layers=2, draft_layers=1)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    file = write_gguf(hf, tmp_path / "f32.gguf", default="F32")
    served = load_model(file)
    assert gguf_file(file) == file
    assert_same_logits(served, hf, 1e-5)


@needs_kernel
def test_quantised_layers_are_the_dequantised_model(gguf_pair):
    _, target_dir = gguf_pair
    served, plain = load_model(target_dir), load_gguf(target_dir / "model.gguf", quantized=False)
    layers = {n: m for n, m in served.named_modules() if isinstance(m, quant.QuantLinear)}
    assert {quant.KERNEL_TYPES[m.qtype][0] for m in layers.values()} == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    plain_modules = dict(plain.named_modules())
    for name, layer in layers.items():
        assert torch.equal(quant.dequantize(layer.blocks, layer.qtype, layer.in_features), plain_modules[name].weight)
    assert not any(isinstance(m, quant.QuantLinear) for m in plain.modules())  # F16 / BF16 layers are plain too
    assert_same_logits(served, plain, 1e-4)


@needs_kernel
def test_a_tree_row_is_the_one_token_step_bit_for_bit(gguf_pair):
    draft_dir, target_dir = gguf_pair
    target = load_model(target_dir)
    assert batch_variance(target) == ""
    invariance.test_a_tree_row_is_the_one_token_step_bit_for_bit(target)
    invariance.test_a_session_gets_its_lone_bits_packed_with_others(target, 3)
    draft = load_model(draft_dir)  # a drafter's lean forward, on QuantLinear layers
    assert use_lean_forward(draft) == "" and batch_variance(draft) == ""
    invariance.test_a_tree_row_is_the_one_token_step_bit_for_bit(draft)
    assert lean_decoder(draft).calls > 0


@pytest.mark.parametrize(("name", "shape"), GREEDY_METHODS[:6])
def test_every_method_is_the_target_greedy(gguf_pair, name, shape):
    draft_dir, target_dir = gguf_pair
    draft, target = load_model(draft_dir), load_model(target_dir)
    prepare_draft(draft)
    gen = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256))
    for prompt in PROMPTS:
        out = gen.generate(prompt, Method.parse(name, shape), SamplingParams(temperature=0), max_new_tokens=12)
        assert out.token_ids == target_greedy(target, prompt, 12)


@pytest.mark.slow
def test_sampling_follows_the_target_law(tmp_path):
    draft_dir, target_dir = build_tiny_gguf_pair(tmp_path, "qwen2", vocab_size=8)
    draft, target = load_model(draft_dir), load_model(target_dir)
    params = SamplingParams(temperature=1.0)
    gen = SpeculativeGenerator(ModelRunner(target, 64), ModelRunner(draft, 64))
    prompt, n, counts = [2, 5, 6], 1500, {}
    for seed in range(n):
        out = gen.generate(prompt, Method.parse("rsd_s", "3x2"), params, max_new_tokens=2, seed=seed)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert chi_square_pvalue(counts, target_law_two_tokens(target, prompt, params), n) > 1e-4


def test_other_dtypes_and_devices_dequantise_on_load(gguf_pair):
    """bfloat16 (as a GPU would serve it): the file's float32 weights, rounded once to the dtype; no QuantLinear."""
    _, target_dir = gguf_pair
    plain = load_gguf(target_dir / "model.gguf", quantized=False)
    bf16 = load_model(target_dir, dtype="bfloat16")
    assert not any(isinstance(m, quant.QuantLinear) for m in bf16.modules()) and bf16.dtype == torch.bfloat16
    expected = dict(plain.named_parameters())
    for name, p in bf16.named_parameters():
        assert torch.equal(p, expected[name].to(torch.bfloat16)), name


def test_a_gguf_drafter_prunes_its_vocabulary_and_takes_int8(gguf_pair):
    """A drafter's law need only be known: its GGUF head is cut to the first ids (rows of blocks) and int8 starts
    from the dequantised weights. The target's greedy output is unchanged."""
    draft_dir, target_dir = gguf_pair
    draft, target = load_model(draft_dir), load_model(target_dir)
    if int8_unsupported(draft):
        pytest.skip(int8_unsupported(draft))
    assert int8_speedup(draft) > 0  # what quantize "auto" measures: int8 against the GGUF blocks
    assert prepare_draft(draft, draft_vocab=100, quantize="int8") == "int8"
    assert not any(isinstance(m, quant.QuantLinear) for m in draft.modules())
    gen = SpeculativeGenerator(ModelRunner(target, 256), ModelRunner(draft, 256))
    out = gen.generate(PROMPTS[0], Method.parse("rsd_s", "3x4"), SamplingParams(temperature=0), max_new_tokens=12)
    assert out.token_ids == target_greedy(target, PROMPTS[0], 12)


def test_refusals(tmp_path, gguf_pair):
    _, target_dir = gguf_pair
    (tmp_path / "a.gguf").write_bytes((target_dir / "model.gguf").read_bytes())
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="2 GGUF files"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="not served from GGUF"):
        gguf_config(write_gguf_of_architecture(tmp_path, "gpt2"))


def write_gguf_of_architecture(tmp_path, arch: str):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / f"{arch}.gguf"


@pytest.mark.skipif(os.environ.get("RSD_TEST_DEVICE", "cpu") == "cpu", reason="RSD_TEST_DEVICE names no accelerator")
def test_on_an_accelerator_the_file_is_dequantised_on_load(gguf_pair):
    """scripts/gpu_check.sh: the file's float32 weights on the device, its logits the CPU blocks' to rounding."""
    device = os.environ["RSD_TEST_DEVICE"]
    _, target_dir = gguf_pair
    on_device, plain = load_model(target_dir, device), load_gguf(target_dir / "model.gguf", quantized=False)
    expected = dict(plain.named_parameters())
    for name, p in on_device.named_parameters():
        assert p.device.type == torch.device(device).type and torch.equal(p.cpu(), expected[name]), name
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        got = on_device(ids.to(device)).logits.cpu()
        torch.testing.assert_close(got, load_model(target_dir)(ids).logits, rtol=1e-3, atol=1e-3)
