"""The public Python API of rsd: what a program imports, re-exported from one place and kept stable.

In process (one draft model and one target, no services):

    from rsd_api import Method, ModelRunner, SamplingParams, SpeculativeGenerator, load_model, load_tokenizer

    target, draft = load_model("path/to/target"), load_model("path/to/draft")   # any HF causal LM, checked
    tok = load_tokenizer("path/to/target")
    gen = SpeculativeGenerator(ModelRunner(target), ModelRunner(draft))
    result = gen.generate(tok("def fib(n):")["input_ids"], Method.parse("rsd_s", "3x4"),
                          SamplingParams(temperature=0.7), max_new_tokens=64, seed=0)
    print(tok.decode(result.token_ids), result.stats.block_efficiency)

Against a running cluster (`rsd cluster`, compose, or your own services):

    from rsd_api import RsdClient
    with RsdClient("127.0.0.1:7000") as client:
        print(client.generate("def fib(n):", method="rsd_s", shape="3x4", max_new_tokens=32).wait().text)

Everything else (rsd_runtime, rsd_service, the services' modules) is internal and may move.
"""

from rsd.methods import DEFAULT_SHAPES, METHOD_NAMES, Method
from rsd.sampling import SamplingParams
from rsd_runtime.attention import UnsupportedModelError
from rsd_runtime.generator import GenerationResult, GenerationStats, SpeculativeGenerator
from rsd_runtime.models import load_model, quantize_draft
from rsd_runtime.runner import ModelRunner
from rsd_runtime.tokenizer import load_tokenizer
from rsd_service.client import Generation, RsdClient
from rsd_service.security import ClientSecurity

__all__ = [
    "DEFAULT_SHAPES",
    "METHOD_NAMES",
    "ClientSecurity",
    "Generation",
    "GenerationResult",
    "GenerationStats",
    "Method",
    "ModelRunner",
    "RsdClient",
    "SamplingParams",
    "SpeculativeGenerator",
    "UnsupportedModelError",
    "load_model",
    "load_tokenizer",
    "quantize_draft",
]
