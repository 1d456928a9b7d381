"""What the benchmark runs: methods as `name[:shape]` specs, the paper protocols (fixed_depth,
fixed_nodes) and the parsing of the flags that choose them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rsd_runtime import DTYPE_NAMES, QUANTIZE_MODES
from rsd_tools.defaults import DEFAULT_SHAPES as METHOD_SHAPES
from rsd_tools.defaults import TEMPERATURES

DEFAULT_SHAPES = {**METHOD_SHAPES, "hf_assisted": ""}  # hf_assisted: transformers' own schedule
QUICK_CONFIG = "ar;sd:4;specinfer:2,2,1;spectr:3x4;rsd_c:2,2,1;rsd_s:3x4;hf_assisted"  # every method, one shape each
NUM_PROMPTS, QUICK_NUM_PROMPTS = 10, 2  # prompts drawn when --num-prompts is not given (without / with --quick)
MAX_NEW_TOKENS, QUICK_MAX_NEW_TOKENS = 64, 24  # likewise --max-new-tokens
DEPTHS = (2, 3, 4, 5)
BUDGETS = (6, 10, 14, 21, 30)
# fixed_nodes: per budget (draft tokens), the shapes each method may use: a deep-narrow and a
# shallow-wide tree for every tree method (nodes <= budget). SD's chain is capped at depth 8 to bound
# its drafting cost (8 draft forwards per target call).
BUDGET_CANDIDATES = {
    6: {"sd": ["6"], "tree": ["2,2", "2,1,1"], "kxl": ["2x3", "3x2"]},
    10: {"sd": ["8"], "tree": ["2,2,1", "2,1,1,1,1"], "kxl": ["2x5", "3x3"]},
    14: {"sd": ["8"], "tree": ["2,2,1,1", "2,2,2"], "kxl": ["2x7", "3x4"]},
    21: {"sd": ["8"], "tree": ["3,2,1,1", "2,2,1,1,1"], "kxl": ["3x7", "4x5"]},
    30: {"sd": ["8"], "tree": ["2,2,2,1,1", "3,3,1"], "kxl": ["5x6", "6x5"]},
}
AR_DTYPES = DTYPE_NAMES  # ar:DTYPE: the target alone, loaded again in that dtype
METHOD_ORDER = ("ar", "sd", "specinfer", "spectr", "rsd_c", "rsd_s", "hf_assisted")


@dataclass(frozen=True)
class Spec:
    name: str  # "ar", "hf_assisted" or an rsd.methods name
    shape: str = ""
    draft: str = ""  # another drafter of --draft-quantize (e.g. "int8"); "" = the first one

    @property
    def label(self) -> str:
        base = f"{self.name}:{self.shape}" if self.shape else self.name
        return f"{base}+{self.draft}" if self.draft else base

    def method(self):
        """The rsd.methods.Method, or None for ar and hf_assisted."""
        from rsd.methods import Method

        return None if self.name in ("ar", "hf_assisted") else Method.parse(self.name, self.shape)


def parse_spec(text: str) -> Spec:
    """ "rsd_s:3x4" / "sd" (default shape) / "ar" / "ar:plain" / "ar:float32" / "hf_assisted:4" -> Spec."""
    name, _, shape = text.strip().partition(":")
    name, shape = name.strip(), shape.strip()
    if name == "ar":
        if shape not in ("", "plain", *AR_DTYPES):
            raise ValueError(
                "ar takes no shape, 'plain' (the target alone with plain F.linear) or a dtype "
                f"({', '.join(AR_DTYPES)}: the target alone loaded in that dtype)"
            )
        return Spec("ar", shape)
    if name == "hf_assisted":
        if shape and not (shape.isdigit() and int(shape) > 0):
            raise ValueError(f"hf_assisted takes a number of draft tokens, got {shape!r}")
        return Spec(name, shape)
    if name not in DEFAULT_SHAPES:
        raise ValueError(f"unknown method {name!r}; expected ar, hf_assisted or one of {', '.join(DEFAULT_SHAPES)}")
    spec = Spec(name, shape or DEFAULT_SHAPES[name])
    spec.method()  # raises ValueError on a bad shape
    return spec


def parse_config(text: str) -> list[Spec]:
    """ "ar;sd:4;rsd_c:2,2,1" -> [Spec, ...] (';' separates methods: shapes use commas)."""
    specs = [parse_spec(part) for part in text.split(";") if part.strip()]
    if not specs:
        raise ValueError(f"no methods in {text!r}")
    return specs


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what}: expected positive integers, got {text!r}")
    return values


def fixed_depth_specs(depth: int) -> list[Spec]:
    """Matched shapes of draft length `depth` (>= 2): every method's tree is `depth` tokens deep."""
    branching = ",".join(["2", "2"] + ["1"] * (depth - 2))
    return [
        Spec("sd", str(depth)),
        Spec("specinfer", branching),
        Spec("spectr", f"3x{depth}"),
        Spec("rsd_c", branching),
        Spec("rsd_s", f"3x{depth}"),
    ]


def fixed_nodes_specs(budget: int) -> list[Spec]:
    """The candidate shapes of every method within `budget` draft tokens (BUDGET_CANDIDATES)."""
    if budget not in BUDGET_CANDIDATES:
        raise ValueError(f"no candidate shapes for a budget of {budget}; known: {sorted(BUDGET_CANDIDATES)}")
    table = BUDGET_CANDIDATES[budget]
    kinds = {"sd": "sd", "specinfer": "tree", "spectr": "kxl", "rsd_c": "tree", "rsd_s": "kxl"}
    specs = [Spec(name, shape) for name, kind in kinds.items() for shape in table[kind]]
    for spec in specs:
        assert spec.method().max_draft_tokens <= budget, spec
    return specs


def plan(protocol: str, depths: list[int], budgets: list[int]) -> tuple[list[Spec], dict[str, list]]:
    """The specs a protocol runs (each once) and, per label, where its rows are reported:
    a list of (protocol, budget or None)."""
    where: dict[str, list] = {"ar": [("baseline", None)]}  # ar and the outside peer belong to no protocol
    specs = [Spec("ar")]
    if protocol in ("fixed_depth", "all"):
        for depth in depths:
            if depth < 2:
                raise ValueError("fixed_depth needs depths >= 2")
            for spec in fixed_depth_specs(depth):
                where.setdefault(spec.label, []).append(("fixed_depth", None))
                specs += [spec] if spec not in specs else []
    if protocol in ("fixed_nodes", "all"):
        for budget in budgets:
            for spec in fixed_nodes_specs(budget):
                where.setdefault(spec.label, []).append(("fixed_nodes", budget))
                specs += [spec] if spec not in specs else []
    hf = Spec("hf_assisted", "")
    where[hf.label] = [("baseline", None)]
    return [*specs, hf], where


def only_methods(specs: list[Spec], text: str) -> list[Spec]:
    """The protocol's specs of the methods named in text ("spectr,rsd_s"), in the protocol's order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in METHOD_ORDER]
    if not names or bad:
        raise ValueError(f"--only: expected method names from {', '.join(METHOD_ORDER)}, got {text!r}")
    return [s for s in specs if s.name in names]


def parse_temperatures(text: str) -> list[float]:
    temps = [float(t) for t in text.split(",") if t.strip()]
    if not temps or any(not (t >= 0 and t < float("inf")) for t in temps):
        raise ValueError(f"temperatures must be finite and >= 0, got {text!r}")
    return temps


def parse_quantize_modes(text: str) -> list[str]:
    """ "none,int8" -> ["none", "int8"]: the drafters to compare (the first is the main one)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in QUANTIZE_MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise ValueError(f"--draft-quantize: expected distinct modes from {QUANTIZE_MODES}, got {text!r}")
    return modes


@dataclass
class Plan:
    """What one benchmark run does, from its flags: every spec (method and drafter), where each label's
    rows are reported, and the shared settings."""

    specs: list[Spec]
    where: dict[str, list]  # label -> [(protocol, budget or None), ...]
    temperatures: list[float]
    quantize_modes: list[str]  # the drafters; the first is the main one
    draft_cost_tokens: tuple[int, ...]
    target_dtype: str
    draft_dtype: str
    num_prompts: int
    max_new_tokens: int
    verification: str = "token"  # every speculative spec's (rsd.methods.Method.rule)


def _insert_ar(specs: list[Spec], where: dict[str, list], shape: str) -> None:
    """Another ar baseline (ar:plain, ar:DTYPE) right after the ar row, reported where ar is."""
    if any(s.name == "ar" for s in specs) and Spec("ar", shape) not in specs:
        specs.insert(1 + [s.name for s in specs].index("ar"), Spec("ar", shape))
        where[f"ar:{shape}"] = where["ar"]


def make_plan(args: argparse.Namespace) -> Plan:
    """The Plan of rsd bench methods' flags; ValueError names a bad flag."""
    from rsd_runtime.models import parse_dtype

    if args.protocol and (args.config or args.method or args.quick):
        raise ValueError("--protocol chooses the shapes itself: drop --config/--method/--quick")
    if args.config or args.method or args.quick:
        specs = (parse_config(args.config) if args.config else []) + [parse_spec(m) for m in args.method]
        specs = specs or parse_config(QUICK_CONFIG)
        where = {s.label: [("custom", None)] for s in specs}
    else:
        depths, budgets = parse_ints(args.depths, "--depths"), parse_ints(args.budgets, "--budgets")
        specs, where = plan(args.protocol or "all", depths, budgets)
        if getattr(args, "only", None):
            specs = only_methods(specs, args.only)
    if args.small_batch_linear:
        _insert_ar(specs, where, "plain")  # the other ar baseline
    target_dtype, draft_dtype = args.target_dtype or args.dtype, args.draft_dtype or args.dtype
    for dtype in args.ar_dtype:
        if parse_dtype(dtype) is parse_dtype(target_dtype, args.device):
            raise ValueError(f"--ar-dtype {dtype} is the target's own dtype: the ar row runs it already")
        _insert_ar(specs, where, dtype)
    temperatures = parse_temperatures(args.temperatures or TEMPERATURES)
    quantize_modes = parse_quantize_modes(args.draft_quantize)
    draft_cost_tokens = tuple(parse_ints(args.draft_cost_tokens, "--draft-cost-tokens"))
    speculative = [s for s in specs if s.method() is not None]
    for mode in quantize_modes[1:]:  # each further drafter runs every speculative method again
        for spec in speculative:
            variant = Spec(spec.name, spec.shape, mode)
            specs.append(variant)
            where[variant.label] = where.get(spec.label, [("custom", None)])
    if len({s.label for s in specs}) != len(specs):
        raise ValueError("a method is listed twice")
    verification = getattr(args, "verification", "token")
    for spec in speculative:
        try:
            spec.method().rule(False, verification)
        except ValueError as e:
            raise ValueError(f"--verification {verification}: {spec.label}: {e}") from None
    return Plan(
        specs,
        where,
        temperatures,
        quantize_modes,
        draft_cost_tokens,
        target_dtype,
        draft_dtype,
        num_prompts=args.num_prompts or (QUICK_NUM_PROMPTS if args.quick else NUM_PROMPTS),
        max_new_tokens=args.max_new_tokens or (QUICK_MAX_NEW_TOKENS if args.quick else MAX_NEW_TOKENS),
        verification=verification,
    )
