"""`rsd` command line.

    rsd generate [--tiny | --draft DIR --target DIR] --method rsd_s --shape 3x4 --prompt "def f(x):"
    rsd generate --server 127.0.0.1:7000 --prompt "def f(x):"   # through a running gateway
    rsd generate --tiny --method sd --temperature 1 --verification block   # another exact rule (rsd.methods)
    rsd cluster [--tiny] [--keep-running]   # start redis, verifier, drafter, gateway as processes
    rsd cluster --tiny --verifiers 2 --secure --keep-running   # any size, secured, restarting the dead
    rsd provision                       # fetch and hash-check the real Qwen2.5-Coder pair (GGUF)
    rsd bench <name> ...                # a benchmark (rsd_bench; added by the console script, rsd_cli)

Without --draft/--target, `generate` uses the real pair (provisioned on first use, then cached);
--tiny builds seeded tiny random models instead, for a smoke run in seconds. With --server the
models are the cluster's; the flags that choose or place models do not apply.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from rsd.methods import VERIFICATIONS
from rsd_runtime import DTYPE_NAMES, NUMERICS, QUANTIZE_MODES
from rsd_service.placement import add_placement_flags
from rsd_tools.defaults import CODE_PROMPT, DEFAULT_METHOD, DEFAULT_SHAPES

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here reaches a model hub

Command = Callable[[list[str]], int]  # a command's own flags -> exit status


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text in-process with a drafter and a target model")
    p.add_argument("--prompt", default=CODE_PROMPT)
    p.add_argument("--method", default=DEFAULT_METHOD, choices=["ar", *DEFAULT_SHAPES])
    p.add_argument("--shape", default=None, help="tree shape: sd '4'; specinfer/rsd_c '2,2,2'; spectr/rsd_s '3x4'")
    p.add_argument(
        "--verification",
        default="token",
        choices=VERIFICATIONS,
        help="the exact rule that verifies the trees at T > 0: token (the method's own), traversal (whole paths), "
        "block (chain shapes only); refused where not exact for the method",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (rsd.penalties)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (rsd.penalties)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0, 1 = off (rsd.penalties)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft", help="draft model folder (any HF causal LM saved locally)")
    p.add_argument("--target", help="target model folder, same tokenizer as the draft")
    p.add_argument("--tiny", action="store_true", help="use tiny seeded random models (fast smoke run)")
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="model cache (default $RSD_MODEL_CACHE or ~/.cache/rsd/models)"
    )
    p.add_argument("--draft-device", default="cpu")
    p.add_argument("--target-device", default="cpu")
    p.add_argument("--draft-dtype", default="float32", choices=[*DTYPE_NAMES, "auto"])
    p.add_argument("--target-dtype", default="float32", choices=[*DTYPE_NAMES, "auto"])
    p.add_argument(
        "--attn-implementation",
        default="auto",
        choices=["auto", "sdpa", "eager"],
        help="attention backend of both models (auto: sdpa where the architecture has it, else eager)",
    )
    p.add_argument(
        "--target-numeric",
        default="auto",
        choices=[*NUMERICS, "auto"],
        help="a GGUF target's numeric mode: exact (its float32 weights) or q8_activations (int8 activations as "
        "llama.cpp computes: another deterministic function, speculation against it still exact; CPU float32); "
        "auto: q8_activations where the model is a GGUF file and this CPU runs the kernel, else exact",
    )
    p.add_argument(
        "--draft-numeric",
        default="auto",
        choices=[*NUMERICS, "auto"],
        help="the GGUF drafter's numeric mode, as --target-numeric (the draft's numeric never changes the output law)",
    )
    p.add_argument("--draft-top-k", type=int, default=0, help="drafter-side truncation of its proposal")
    p.add_argument("--draft-top-p", type=float, default=1.0)
    p.add_argument("--max-len", type=int, default=2048, help="KV cache capacity per model, in tokens")
    add_placement_flags(p)
    p.add_argument(
        "--draft-quantize",
        default="none",
        choices=QUANTIZE_MODES,
        help="int8: dynamic int8 linear layers in the drafter (CPU; exact: the target is never quantised); "
        "auto: int8 where the VNNI kernel takes a drafter too large for the cache",
    )
    p.add_argument(
        "--small-batch-linear",
        type=int,
        default=0,
        metavar="ROWS",
        help="compute linear layers as weight @ x.T up to ROWS rows (fast trees on CPU; 0 = off)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        metavar="K",
        help="the drafter scores only the first K vocabulary ids (a cheaper output layer; still exact; 0 = all)",
    )
    p.add_argument(
        "--lookup-n",
        type=int,
        default=0,
        metavar="N",
        help="merge context lookups into the model's trees: a node whose context ends in a repeated n-gram of "
        ">= N tokens takes the law of what followed it, with no draft forward (still exact; 0 = off)",
    )
    p.add_argument(
        "--predraft",
        type=int,
        default=0,
        metavar="N",
        help="in-process: pre-draft the next tree for the N likeliest verdicts before each verification "
        "(sequential here, so no faster: it reports the hit rate the drafter service would get; same tokens)",
    )
    p.add_argument("--server", metavar="HOST:PORT", help="generate through the gateway at HOST:PORT")
    p.add_argument("--session-id", default="", help="with --server: continue this session with the prompt as its turn")
    p.add_argument("--stop", action="append", default=[], help="with --server: a stop sequence (repeatable)")
    p.add_argument(
        "--token-file", default="", help="with --server: file holding the gateway's bearer token (or env RSD_TOKEN)"
    )
    p.add_argument("--tls-ca", default="", help="with --server: CA certificate (PEM) of the gateway: use TLS")
    p.add_argument("--tls-cert", default="", help="with --server: client certificate (PEM) for mTLS")
    p.add_argument("--tls-key", default="", help="with --server: the client certificate's key (PEM)")


def generate_remote(args) -> int:
    """Stream a generation from a gateway; stats to stderr."""
    import time

    import grpc

    from rsd_service.client import RsdClient
    from rsd_service.security import ClientSecurity, read_secret
    from rsd_tools.cluster import print_stats

    if args.method == "ar":
        raise SystemExit("error: the gateway serves speculative methods only (not ar)")
    try:  # the token from a file or the environment: never on the command line, where `ps` shows it
        token = read_secret("" if args.token_file else os.environ.get("RSD_TOKEN", ""), args.token_file, "token")
        security = ClientSecurity(args.tls_ca, args.tls_cert, args.tls_key, token)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    with RsdClient(args.server, security=security) as client:
        gen = client.generate(
            args.prompt,
            session_id=args.session_id,
            method=args.method,
            shape=args.shape,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            stop=args.stop,
            seed=args.seed,
            verification=args.verification,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
        )
        t0 = time.perf_counter()
        try:
            if not args.session_id:
                sys.stdout.write(args.prompt)
            for delta in gen:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        sys.stdout.write("\n")
        print_stats(gen, time.perf_counter() - t0)
    return 0


def generate(args) -> int:
    if args.server:
        return generate_remote(args)
    import torch
    from transformers.utils import logging as hf_logging

    from rsd.methods import Method
    from rsd.sampling import SamplingParams
    from rsd_runtime.attention import UnsupportedModelError
    from rsd_runtime.generator import SpeculativeGenerator
    from rsd_runtime.linear import use_small_batch_linear
    from rsd_runtime.models import load_model, prepare_draft
    from rsd_runtime.predraft import PipelinedGenerator
    from rsd_runtime.runner import ModelRunner
    from rsd_runtime.tokenizer import load_tokenizer
    from rsd_service.placement import apply_placement
    from rsd_tools.launcher import model_dirs

    hf_logging.disable_progress_bar()
    try:
        placement = apply_placement(args.cores, args.threads)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"placement: cores {placement.cores}, {torch.get_num_threads()} threads", file=sys.stderr)
    try:
        params = SamplingParams(
            args.temperature,
            args.top_k,
            args.top_p,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
        )
        method = None if args.method == "ar" else Method.parse(args.method, args.shape or DEFAULT_SHAPES[args.method])
        if method is not None:
            method.rule(params.greedy, args.verification)  # refused before the models load
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    draft_dir, target_dir = model_dirs(args.draft, args.target, args.cache_dir, args.tiny)
    print(f"loading target {target_dir} ({args.target_device}, {args.target_dtype})", file=sys.stderr)
    tokenizer = load_tokenizer(target_dir)

    def load(path, device, dtype, draft_vocab=None, quantize="none", numeric="exact"):  # draft_vocab: the drafter
        try:
            model = load_model(path, device, dtype, args.attn_implementation, numeric=numeric)
        except ValueError as e:
            if numeric == "exact":
                raise
            raise SystemExit(f"error: {path}: {e}") from None
        print(f"  {type(model).__name__}, attention {model.config._attn_implementation}", file=sys.stderr)
        try:  # drafter only: prune, quantise, lean forward (rsd_runtime.models.prepare_draft)
            applied = prepare_draft(model, draft_vocab, quantize, dtype) if draft_vocab is not None else "none"
        except ValueError as e:
            raise SystemExit(f"error: {path}: {e}") from None
        if quantize != "none":
            print(f"  draft quantize {quantize}: {applied}", file=sys.stderr)
        if args.small_batch_linear:
            use_small_batch_linear(model, args.small_batch_linear)
        try:
            return ModelRunner(model, args.max_len)
        except UnsupportedModelError as e:
            raise SystemExit(f"error: {path}: {e}") from None

    from rsd_tools.cluster import serving_numeric

    target_numeric = serving_numeric(
        args.target_numeric, target_dir, dtype=args.target_dtype, device=args.target_device
    )
    print(f"  target numeric {target_numeric}", file=sys.stderr)
    target = load(target_dir, args.target_device, args.target_dtype, numeric=target_numeric)
    draft = None
    if method is not None and not method.draft_free:
        draft_numeric = serving_numeric(args.draft_numeric, draft_dir, dtype=args.draft_dtype, device=args.draft_device)
        print(
            f"loading draft {draft_dir} ({args.draft_device}, {args.draft_dtype}, numeric {draft_numeric})",
            file=sys.stderr,
        )
        draft = load(
            draft_dir, args.draft_device, args.draft_dtype, args.draft_vocab, args.draft_quantize, draft_numeric
        )
    if args.predraft and draft is not None:
        gen = PipelinedGenerator(
            target,
            draft,
            args.predraft,
            draft_top_k=args.draft_top_k,
            draft_top_p=args.draft_top_p,
            lookup_n=args.lookup_n,
        )
    else:
        gen = SpeculativeGenerator(target, draft, args.draft_top_k, args.draft_top_p, args.lookup_n)
    prompt_ids = tokenizer.encode(args.prompt)
    eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
    out = gen.generate(prompt_ids, method, params, args.max_new_tokens, eos, args.seed, args.verification)
    s = out.stats
    print(args.prompt + tokenizer.decode(out.token_ids))
    shape = "" if method is None else f" {args.shape or DEFAULT_SHAPES[args.method]}"
    print(
        f"\n[{s.method}{shape} T={params.temperature} rule={s.rule or '-'}] {s.new_tokens} tokens in {s.total_s:.2f} s "
        f"({s.tokens_per_s:.2f} tok/s); {s.target_calls} target calls, block efficiency {s.block_efficiency:.2f}; "
        f"draft {s.draft_s:.2f} s ({s.draft_forwards} forwards), verify {s.verify_s:.2f} s; "
        f"acceptance by depth {[round(a, 2) for a in s.acceptance_by_depth]}",
        file=sys.stderr,
    )
    if isinstance(gen, PipelinedGenerator):
        print(
            f"pre-drafting: {s.predraft_hits} hits, {s.predraft_misses} misses, {s.predraft_trees} trees drafted "
            f"ahead, {s.wasted_draft_forwards} wasted draft forwards",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None, more: dict[str, tuple[str, Command]] | None = None) -> int:
    """Run one `rsd` command. `more` adds commands of the layers above, name -> (help, run(argv)): the `rsd`
    console script (rsd_cli) adds `bench` this way, so this module never imports the benchmarks."""
    ap = argparse.ArgumentParser(prog="rsd", description="Recursive Speculative Decoding")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    prov = sub.add_parser("provision", help="fetch and verify the real pair (GGUF; --fp32 also dequantises)")
    prov.add_argument("--cache-dir", type=Path, default=None)
    sub.add_parser(
        "cluster",
        add_help=False,
        help="start redis, verifiers, drafters and gateways as processes, optionally secured (rsd cluster -h)",
    )
    for name, (help_text, _) in (more or {}).items():
        sub.add_parser(name, add_help=False, help=help_text)
    args, rest = ap.parse_known_args(argv)
    if args.command in (more or {}):
        return more[args.command][1](rest)
    if args.command == "cluster":
        from rsd_tools.cluster import main as cluster_main

        return cluster_main(rest)
    if args.command == "provision":
        from rsd_tools.provision import main as provision_main

        return provision_main((["--cache-dir", str(args.cache_dir)] if args.cache_dir else []) + rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    return generate(args)


if __name__ == "__main__":
    sys.exit(main())
