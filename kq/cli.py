"""The ``kq`` command line: ``kq check``, ``kq bench``, ``kq demo``, ``kq generate`` and ``kq study``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

# `kq demo --help`'s epilog; {columns}: what each column of --random's tables is (kq.demo_random.column_legend).
DEMO_EPILOG = """\
By default the demo continues --prompt with the shipped model (a Qwen3-MoE trained on the Python
standard library's source), greedily, once through an arena of --residency of each layer's experts,
filled between tokens by the residency manager from the checkpoint's safetensors files, and once
with every expert in memory; it prints both texts and the arena's hit rate, shed gate weight, reads
and speed, each explained.

With --random it decodes --steps steps twice per framework: once with every expert in memory
(resident) and once streamed, each layer's experts served from an arena of --residency of its
experts that the residency manager fills from safetensors files between steps. Columns, per
framework:
{columns}

Files: the shipped model is read where it is; with --random the random checkpoint is written to a
temporary directory, deleted at the end, and the plot goes to --plot."""


def _check(args, parser) -> int:
    from kq.backends import all_backends, backend
    from kq.check import (ImplementationError, format_failed_case, format_table, implementation_backend, run_checks,
                          was_interrupted)

    if args.impl_arrays != "numpy" and not args.impl:
        parser.error("--impl-arrays applies to the functions of --impl; give --impl MODULE:FUNCTION")
    if args.impl_arrays != "numpy" and importlib.util.find_spec(args.impl_arrays) is None:
        parser.error(f"--impl-arrays {args.impl_arrays}: {args.impl_arrays} is not installed")
    impls = []
    if args.impl:
        # MODULE is found as `python -m` finds it: from the current directory first.
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        for target in args.impl:
            try:
                impls.append(implementation_backend(target, args.impl_arrays, timeout=args.timeout or None))
            except ImplementationError as error:
                parser.error(f"--impl {error}")
    names = args.backends or ([] if impls else [b.name for b in all_backends()])
    chosen = (*(backend(n) for n in names), *impls)
    random_rows = args.random_rows if args.random_rows is not None else (16384 if args.thorough else 4096)
    reports = run_checks(chosen, random_rows=random_rows, seed=args.seed, thorough=args.thorough, progress=True)
    print(format_table(reports))
    for report in reports:
        if report.skipped_cases:
            print(f"\n{report.name}: {report.skipped_cases} cases skipped, each needing an option the function does "
                  f"not take; the first, {report.skip_reason}")
    for report in reports:
        if report.first_failed_case is not None:
            case = format_failed_case(report.name, report.first_failed_case, seed=args.seed, random_rows=random_rows)
            print(f"\n{report.name}: the first differing case, as a test:\n```python\n{case}\n```")
    failed = [r for r in reports if not r.skipped and not r.ok]
    ran = [r for r in reports if not r.skipped]
    what = ("implementation" if impls else "backend") + ("" if len(ran) == 1 else "s")
    print(f"\n{len(ran)} {what} ran, {len(failed)} with mismatches, {len(reports) - len(ran)} skipped")
    if was_interrupted(reports):
        return 130
    return 1 if failed or not ran else 0


def _shape(text: str) -> tuple[int, int, int]:
    from kq.bench.kernels import parse_shape

    try:
        return parse_shape(text)
    except ValueError as error:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(error)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1], got {text}")
    return value


def _output_path(text: str) -> Path | None:
    """A file to write at the end of a run (``''``: none), checked writable before the run starts."""
    if not text:
        return None
    path = Path(text)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path.parent} is not a directory to write {path.name} into")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory, not a file to write")
    # Opened for writing now, so a place no file can be made in is named before the run, not after it; a pipe
    # or a device (/dev/stdout) is left to the write.
    try:
        if path.is_file():
            path.open("ab").close()
        elif not path.exists():  # made where a dangling link points, as the write will
            target = Path(os.path.realpath(path))
            target.open("xb").close()
            target.unlink()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{path} cannot be written ({error.strerror or error})") from None
    return path


def _bench(args, parser) -> int:
    from kq.bench import kernels

    # Sets that run alone, each a module with run(progress=...), format_table(result), write_json(result, path).
    for alone, module_name, what in (("compile", "compiles", "first calls at new row counts, not one shape"),
                                     ("host", "host", "the residency manager, not route_shed"),
                                     ("decode-e2e", "decode_e2e", "decoding through an arena, not route_shed")):
        if not args.sets or alone not in args.sets:
            continue
        if len(args.sets) > 1 or args.shapes:
            print(f"kq bench: --sets {alone} runs alone ({what})")
            return 2
        if args.models and alone != "decode-e2e":
            print("kq bench: --models picks decode-e2e's models; give --sets decode-e2e")
            return 2
        module = importlib.import_module(f"kq.bench.{module_name}")
        result = module.run(progress=not args.no_progress, **({"models": args.models} if args.models else {}))
        print(module.format_table(result))
        if args.json:
            module.write_json(result, args.json)
            print(f"wrote {args.json}")
        return 0
    if args.models:
        print("kq bench: --models picks decode-e2e's models; give --sets decode-e2e")
        return 2
    sets = args.sets or ([] if args.shapes else ["decode"])
    try:
        results = kernels.run(tuple(sets), args.backends, shapes=tuple(args.shapes or ()), repeats=args.repeats,
                              resident_fraction=args.resident_fraction, progress=not args.no_progress)
    except kernels.UnknownBackendError as error:  # the backends are known only once their frameworks have started
        parser.error(f"--backends: {str(error).removeprefix('kq bench: ')}")
    print(kernels.format_table(results))
    if args.json:
        kernels.write_json(results, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        kernels.write_plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


# `kq demo`'s options that apply to one of its two runs only: given to the other, refused. Those not given
# take ModelDemoConfig's or DemoConfig's defaults (the random stack's plot: DEMO_RANDOM_PLOT).
DEMO_RANDOM_ONLY = ("layers", "experts", "top_k", "hidden", "ffn", "rows", "steps", "keep_mass", "read_budget",
                    "seed", "plot")
DEMO_MODEL_ONLY = ("checkpoint", "prompt", "tokens", "rule", "tier_bits")
DEMO_RANDOM_PLOT = Path("kq_demo.png")


def _refuse_other_runs_options(args, parser) -> None:
    """Refuses an option given that belongs to the other of ``kq demo``'s two runs."""
    other = DEMO_MODEL_ONLY if args.random else DEMO_RANDOM_ONLY
    for name in other:
        if hasattr(args, name):
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} does not apply with --random" if args.random else
                         f"{flag} only applies with --random")


def _given(args, names) -> dict:
    """The options among ``names`` given on the command line (the others are absent from ``args``)."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


class _CheckpointFaults:
    """What the checkpoint's files hold, met while a run reads them, ends ``kq demo`` or ``kq study`` in one line:
    a tensor refused as ``--checkpoint`` (a usage error), a read that failed as the disk's (exit 1, true as the
    context's value; no usage line)."""

    def __init__(self, command: str, parser):
        self.command, self.parser, self.ended = command, parser, False

    def __enter__(self) -> "_CheckpointFaults":
        return self

    def __bool__(self) -> bool:
        return self.ended

    def __exit__(self, kind, error, _traceback) -> bool:
        from kq_host.checkpoint import CheckpointError
        from kq_host.expert_store import ExpertStoreError
        from kq_host.residency import PreloadError

        if isinstance(error, PreloadError):
            print(f"\nkq {self.command}: reading experts failed: {error}", file=sys.stderr)
            self.ended = True
            return True
        if isinstance(error, (CheckpointError, ExpertStoreError)) or (
                isinstance(error, ValueError) and str(error).startswith("--checkpoint")):
            message = str(error)
            self.parser.error(message if message.startswith("--checkpoint") else f"--checkpoint: {message}")
        return False


def _demo_model(args, parser) -> int:
    from kq import demo

    frameworks = tuple(args.frameworks or demo.installed_frameworks())
    if not frameworks or importlib.util.find_spec("tokenizers") is None:
        print("kq demo needs mlx-lm or JAX, and tokenizers (pip install -e '.[demo]')")
        return 1
    try:
        config = demo.ModelDemoConfig(**_given(args, DEMO_MODEL_ONLY), residency=args.residency, policy=args.policy,
                                      frameworks=frameworks)
    except ValueError as error:
        parser.error(str(error))
    from kq.terminal import phase_lines

    print(demo.format_header(config), flush=True)
    say = phase_lines("kq demo")  # on stderr, as kq check's progress
    for framework in config.frameworks:
        with _CheckpointFaults("demo", parser) as ended:
            texts = demo.generate_texts(config, framework, say)
        if ended:
            return 1
        print(demo.format_texts(config, texts))
    return 0


def _demo_random(args, parser) -> int:
    from kq import demo_random

    frameworks = tuple(args.frameworks) if args.frameworks else demo_random.available_frameworks()
    try:
        cfg = demo_random.DemoConfig(**_given(args, (n for n in DEMO_RANDOM_ONLY if n != "plot")),
                                     residency=args.residency, policy=args.policy, frameworks=frameworks)
    except ValueError as error:
        parser.error(str(error))
    missing = [m for m in ("safetensors", "matplotlib") if importlib.util.find_spec(m) is None]
    if not cfg.frameworks or missing:
        print(f"kq demo needs JAX or mlx-lm, safetensors and matplotlib; missing: "
              f"{', '.join(missing) or 'JAX and mlx-lm'} (pip install -e '.[demo]')")
        return 1
    from kq.terminal import phase_lines

    with _CheckpointFaults("demo", parser) as ended:
        traces = demo_random.run(cfg, say=phase_lines("kq demo"))
    if ended:
        return 1
    print(demo_random.summarize(cfg, traces))
    plot = getattr(args, "plot", DEMO_RANDOM_PLOT)
    if plot:
        demo_random.plot(traces, plot)
        print(f"wrote {plot}")
    return 0


def _demo(args, parser) -> int:
    _refuse_other_runs_options(args, parser)
    return _demo_random(args, parser) if args.random else _demo_model(args, parser)


def _generate(args, parser) -> int:
    from kq.generate import GenerateConfig, GenerateError, format_summary, generate
    from kq_host.residency import PreloadError

    def progress(done: int, total: int) -> None:
        if total > 1 and sys.stderr.isatty():  # the prompt read in passes: a line that rewrites itself
            print(f"\rreading the prompt: {done}/{total} tokens", end="" if done < total else "\n", file=sys.stderr,
                  flush=True)

    config = GenerateConfig(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens, residency=args.residency,
                            memory=args.memory, context=args.context, rule=args.rule, tier_bits=args.tier_bits,
                            tier_group_size=args.tier_group_size, tier_model=args.tier_model,
                            queue_depth=args.queue_depth, timeout=args.timeout, float32=args.float32, temp=args.temp,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                            chat_template=not args.ignore_chat_template, system_prompt=args.system_prompt,
                            floor=args.floor, progress=progress)
    echoed = []

    def show(text: str) -> None:
        if not echoed:  # the prompt first, so the continuation reads on from it
            echoed.append(True)
            print(args.prompt, end="", flush=True)
        print(text, end="", flush=True)

    try:
        result = generate(config, on_text=show)
    except GenerateError as error:
        parser.error(str(error))
    except PreloadError as error:  # the disk, not an argument: no usage line
        waited = f" (--timeout {args.timeout} s)" if args.timeout is not None else ""
        print(f"\nkq generate: reading experts failed{waited}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nkq generate: interrupted", file=sys.stderr)
        return 130
    print()
    print(format_summary(result))
    if args.json is not None:
        import json

        try:
            args.json.write_text(json.dumps(result.to_json(), indent=1))
        except OSError as error:
            print(f"kq generate: --json: cannot write {args.json} ({error.strerror or error})", file=sys.stderr)
            return 1
    return 0


def _study(args, parser) -> int:
    from kq import study
    from kq.study_runner import make_study

    try:
        config = study.StudyConfig(checkpoint=args.checkpoint, text=args.text, tokens=args.tokens, warmup=args.warmup,
                                   residencies=tuple(args.residency), policies=tuple(args.policies),
                                   rules=tuple(args.rules) if args.rules else None, framework=args.framework,
                                   tier_bits=args.tier_bits, tier_group_size=args.tier_group_size,
                                   streams=args.streams, long_context=args.long_context)
        if args.lookahead and config.framework != "jax":
            raise ValueError("--lookahead replays the routing recorded in JAX; use --framework jax")
        if args.prefetch_budget and not args.lookahead:
            raise ValueError("--prefetch-budget only applies with --lookahead")
        runner = make_study(config)  # reads and checks the text
    except ValueError as error:
        parser.error(str(error))
    with _CheckpointFaults("study", parser) as ended:
        resident, results = study.run_study(runner, progress=not args.no_progress)
    if ended:
        return 1
    print(study.format_table(resident, results))
    replay = None
    if args.lookahead:
        from kq.replay import format_replay, replay_grid

        replay = replay_grid(dataclasses.replace(config, streams=1), config.residencies, config.policies,
                             depths=sorted({0, *args.lookahead}), budgets=(None, *args.prefetch_budget))
        print("\nThe exact loop replayed (kq.replay.simulate: a prefetch issued after layer l lands "
              f"before layer l+1 routes), {config.tokens} tokens:")
        print(format_replay(replay))
    for path, write in ((args.json, study.write_json), (args.plot, None)):
        if path:
            if write:
                write(config, resident, results, path, lookahead=replay)
            else:
                study.write_plot(resident, results, path)
            print(f"wrote {path}")
    return 0


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, except a default of None or False (the help says what then)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _check_options(check) -> None:
    from kq.backends import all_backends
    from kq.check import DEFAULT_TIMEOUT

    names = [b.name for b in all_backends()]
    check.add_argument("--backends", nargs="+", metavar="NAME", choices=names,
                       help=f"subset of: {', '.join(names)} (default: all)")
    check.add_argument("--random-rows", type=_count(0), default=None,
                       help="random rows per backend, besides the golden cases (default 4096; with --thorough "
                            "16384); the Pallas interpreter takes at most 512 of them, over one dtype pair per "
                            "shape, unless --thorough")
    check.add_argument("--thorough", action="store_true",
                       help="every backend, the interpreter too, over every random shape and dtype pair")
    check.add_argument("--seed", type=int, default=0, help="seed of the random rows")
    check.add_argument("--impl", action="append", metavar="MODULE:FUNCTION",
                       help="also check this function of another project (repeatable; MODULE found from the current "
                            "directory first): it gets the golden cases and the random rows, num_slots and on_miss "
                            "only if its signature takes them (the cases needing one it lacks are skipped and "
                            "counted); kq's backends then run only as --backends names them (docs/conformance.md)")
    check.add_argument("--impl-arrays", choices=("numpy", "jax", "mlx"), default="numpy",
                       help="the arrays --impl functions are given; their outputs may be any arrays NumPy reads")
    check.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                       help="seconds an --impl function may take on one case before it fails as hung (0: no limit)")
    check.set_defaults(func=lambda args: _check(args, check))


def _bench_options(bench) -> None:
    from kq.bench.decode_e2e import RANDOM_MODELS, RECORDED_MODELS
    from kq.bench.kernels import SHAPE_SETS

    bench.add_argument("--sets", nargs="+", choices=sorted([*SHAPE_SETS, "host", "compile", "decode-e2e"]),
                       help="named shape sets (default: decode, unless --shapes is given); host: the residency "
                            "manager's token boundary at real model sizes instead of route_shed; compile: the JAX "
                            "kernels' first call at new row counts, with and without row buckets; decode-e2e: decoding "
                            "through an arena end to end, the resident model beside lossy, tier and exact arenas")
    bench.add_argument("--models", nargs="+", choices=[*RECORDED_MODELS, *RANDOM_MODELS],
                       help="decode-e2e's models (default: every model where JAX runs on a GPU, two small ones else)")
    bench.add_argument("--shapes", nargs="+", type=_shape, metavar="TxKxE",
                       help="shapes of your own model, e.g. 1x8x128 (rows x top-k x experts)")
    bench.add_argument("--backends", nargs="+", metavar="NAME", help="subset of the backends found here")
    bench.add_argument("--repeats", type=_count(1), default=7)
    bench.add_argument("--resident-fraction", type=_fraction, default=0.7,
                       help="fraction of the experts resident in the random rows, in [0, 1]")
    bench.add_argument("--json", metavar="PATH", type=_output_path, help="write the results as JSON")
    bench.add_argument("--plot", metavar="PATH", type=_output_path, help="write a PNG plot (needs matplotlib)")
    bench.add_argument("--no-progress", action="store_true")
    bench.set_defaults(func=lambda args: _bench(args, bench))


def _demo_options(demo) -> None:
    from kq.demo import DEMO_RULES
    from kq.demo_random import column_legend
    from kq_host.tier import BITS as TIER_BITS
    from kq_host.tier import DEFAULT_TIER_BITS

    demo.epilog = DEMO_EPILOG.format(columns=column_legend())

    demo.add_argument("--frameworks", nargs="+", choices=["jax", "mlx"],
                      help="frameworks to run (default: every one installed)")
    demo.add_argument("--checkpoint", type=Path, default=argparse.SUPPRESS,
                      help="a qwen3_moe checkpoint directory (default: the shipped models/stdlib-moe)")
    demo.add_argument("--prompt", default=argparse.SUPPRESS, help="text to continue (default: a function header)")
    demo.add_argument("--tokens", type=_count(1), default=argparse.SUPPRESS, help="tokens to generate (default 48)")
    demo.add_argument("--random", action="store_true",
                      help="instead: a random MoE stack of the sizes below, decoded resident and streamed (the "
                           "columns are explained below)")
    demo.add_argument("--layers", type=int, default=argparse.SUPPRESS, help="MoE layers (default 8)")
    demo.add_argument("--experts", type=int, default=argparse.SUPPRESS, help="experts per layer (default 64)")
    demo.add_argument("--top-k", type=int, default=argparse.SUPPRESS,
                      help="experts routed per token, <= experts and 64 (default 8)")
    demo.add_argument("--hidden", type=int, default=argparse.SUPPRESS, help="hidden size (default 256)")
    demo.add_argument("--ffn", type=int, default=argparse.SUPPRESS, help="expert width (default 128)")
    demo.add_argument("--rows", type=int, default=argparse.SUPPRESS, help="tokens decoded per step (default 1)")
    demo.add_argument("--steps", type=int, default=argparse.SUPPRESS, help="decode steps (default 200)")
    demo.add_argument("--residency", type=float, default=0.25,
                      help="fraction of each layer's experts in the arena, in (0, 1] (default 0.25)")
    demo.add_argument("--policy", choices=["lfu", "lru"], default="lfu",
                      help="eviction policy: lfu evicts the least frequently used expert (counts decayed over "
                           "time), lru the least recently used (default lfu)")
    demo.add_argument("--rule", choices=DEMO_RULES, default=argparse.SUPPRESS,
                      help="the shipped model's misses: served by a low-precision copy of every expert (tier, the "
                           "default), shed (route_shed rescales the kept weights, shed does not), or read before "
                           "their layer's experts run, the next layer's experts prefetched (exact: the layer-by-layer "
                           "loop, the resident model's text)")
    demo.add_argument("--tier-bits", type=int, choices=TIER_BITS, default=argparse.SUPPRESS,
                      help=f"--rule tier: bits per weight of the low-precision copy of every expert (default "
                           f"{DEFAULT_TIER_BITS}, as kq generate's and kq study's)")
    demo.add_argument("--keep-mass", type=float, default=argparse.SUPPRESS,
                      help="shed-mass budget: a layer-step shedding more than 1 - this of its routed mass "
                           "counts as over-budget (default 0.9)")
    demo.add_argument("--read-budget", type=int, default=argparse.SUPPRESS,
                      help="expert reads per step (default: no limit)")
    demo.add_argument("--seed", type=int, default=argparse.SUPPRESS, help="seed of weights and inputs (default 0)")
    demo.add_argument("--plot", metavar="PATH", type=_output_path, default=argparse.SUPPRESS,
                      help="with --random: where to write the PNG of hit rate and shed mass per step (default "
                           "kq_demo.png; '' for none)")
    demo.set_defaults(func=lambda args: _demo(args, demo))


def _generate_options(generate_parser) -> None:
    from kq.model_options import add_model_options

    add_model_options(generate_parser)
    generate_parser.add_argument("--prompt", required=True,
                                 help="the text to continue, or the user's message where the tokenizer has a chat "
                                      "template")
    generate_parser.add_argument("--max-tokens", type=_count(1), default=64, help="tokens to generate (default 64)")
    generate_parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    generate_parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    generate_parser.add_argument("--top-k", type=_count(0), default=0, help="top-k sampling (default 0: off)")
    generate_parser.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (default 0: off)")
    generate_parser.add_argument("--seed", type=_count(0), default=None, help="MLX's random seed for the sampling")
    generate_parser.add_argument("--ignore-chat-template", action="store_true",
                                 help="continue the prompt as it is, even where the tokenizer has a chat template")
    generate_parser.add_argument("--system-prompt", default=None, help="the chat template's system message")
    generate_parser.add_argument("--tier-model", type=Path, default=None,
                                 help="--rule tier: read the tier from this lower-bit mlx-lm conversion of the model")
    generate_parser.add_argument("--queue-depth", type=_count(0), default=8,
                                 help="reads in flight, at most 256 (default 8)")
    generate_parser.add_argument("--timeout", type=float, default=None,
                                 help="seconds a wait for reads may take before the run fails (default: no limit)")
    generate_parser.add_argument("--floor", action="store_true",
                                 help="also measure the time to first token's floor: the prompt's experts read "
                                      "again, and the model loaded whole (it must fit in memory) for its prefill")
    generate_parser.add_argument("--json", type=_output_path, default=None, help="write the figures to this JSON file")
    generate_parser.set_defaults(func=lambda args: _generate(args, generate_parser))


def _study_options(study_parser) -> None:
    from kq import study
    from kq_host.tier import BITS as TIER_BITS
    from kq_host.tier import DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE
    from kq_host.tier import GROUP_SIZES as TIER_GROUP_SIZES

    study_parser.add_argument("--framework", choices=["jax", "mlx"], default="jax",
                              help="decode with kq_jax's Qwen3-MoE or with mlx-lm's unmodified model (default jax)")
    study_parser.add_argument("--checkpoint", type=Path, default=study.SHIPPED_MODEL,
                              help="a checkpoint directory in the Hugging Face layout: qwen3_moe, or mixtral with "
                                   "--framework mlx (default: the shipped models/stdlib-moe)")
    study_parser.add_argument("--text", type=Path, help="text to decode (default: the checkpoint's heldout.txt)")
    study_parser.add_argument("--tokens", type=int, default=256, help="scored tokens per run (default 256)")
    study_parser.add_argument("--warmup", type=int, default=64, help="tokens decoded before scoring (default 64)")
    study_parser.add_argument("--residency", type=float, nargs="+", default=list(study.RESIDENCIES),
                              help="fractions of each layer's experts in the arena (default: 1 .75 .5 .25 .125)")
    study_parser.add_argument("--policies", nargs="+", choices=study.POLICIES, default=list(study.POLICIES),
                              help="eviction policies of the arena: lfu evicts the least frequently used expert "
                                   "(counts decayed over time), lru the least recently used (default: both)")
    study_parser.add_argument("--rules", nargs="+", choices=study.RULES,
                              help="default: every rule the framework runs")
    study_parser.add_argument("--tier-bits", type=int, choices=TIER_BITS, default=DEFAULT_TIER_BITS,
                              help=f"bits per weight of the tier rule's low-precision copy of every expert (default "
                                   f"{DEFAULT_TIER_BITS})")
    study_parser.add_argument("--tier-group-size", type=int, choices=TIER_GROUP_SIZES, default=DEFAULT_TIER_GROUP_SIZE,
                              help=f"weights sharing one scale and bias in the tier (default {DEFAULT_TIER_GROUP_SIZE})")
    study_parser.add_argument("--streams", type=int, default=1,
                              help="windows of --warmup + --tokens decoded side by side, spread over the text, each "
                                   "with its own arena's state; their tokens are the run's, the bootstrap draws "
                                   "windows (JAX; default 1)")
    study_parser.add_argument("--long-context", action="store_true",
                              help="decode each stream as one window of --warmup + --tokens, scoring tokens past the "
                                   "length the checkpoint was trained on (the output then says LONG CONTEXT); by "
                                   "default windows stay within it, overlapping by --warmup")
    study_parser.add_argument("--lookahead", type=int, nargs="+", choices=[1, 2], default=[],
                              help="also replay the exact loop (stall) with the next layers' routers' predictions "
                                   "prefetched, this many layers ahead, beside none (JAX; docs/lookahead.md)")
    study_parser.add_argument("--prefetch-budget", type=_count(1), nargs="+", default=[],
                              help="with --lookahead: also replay with at most this many prefetches per layer and "
                                   "token")
    study_parser.add_argument("--json", metavar="PATH", type=_output_path, help="write every run's numbers as JSON")
    study_parser.add_argument("--plot", metavar="PATH", type=_output_path,
                              help="write perplexity and hit rate against residency (PNG)")
    study_parser.add_argument("--no-progress", action="store_true",
                              help="print no progress on stderr (a bar on a terminal; elsewhere a line now and then)")
    study_parser.set_defaults(func=lambda args: _study(args, study_parser))


# Each subcommand: the function adding its options (which imports what they need: backend names, shape sets,
# the study's grid), and add_parser's keywords (its help line in `kq --help` among them).
SUBCOMMANDS = {
    "check": (_check_options, dict(help="run every golden case and random rows through every backend",
                                   formatter_class=_DefaultsHelpFormatter)),
    "bench": (_bench_options, dict(help="time every backend here against its floors and the naive baseline",
                                   formatter_class=_DefaultsHelpFormatter)),
    "demo": (_demo_options, dict(help="generate text with the shipped model through an arena of a quarter of its "
                                      "experts (--random: a random MoE stack)",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)),
    "generate": (_generate_options, dict(
        help="generate text with an mlx-lm MoE model directory, its experts streamed through an arena",
        description="Generates text with any mlx-lm MoE model directory (float or quantized) as mlx_lm.generate "
                    "does (its sampler, the tokenizer's chat template), the model loaded by kq_mlx.load: each MoE "
                    "layer keeps --residency of its experts (or what --memory leaves) in an arena, filled from the "
                    "directory's safetensors files by the residency manager; no other expert is ever in memory. "
                    "The prompt runs layer by layer, each expert it routes to read once; then each token under "
                    "--rule. The text is printed as it comes, then the speeds, hit rate, reads and peak memory.")),
    "study": (_study_options, dict(
        help="what shedding costs a trained model: perplexity through a bounded arena, per rule and policy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The rules, the columns and the method: docs/shedding_study.md and the module kq/study.py. The default "
               "grid (73 runs and the resident one, each of 256 scored tokens in two windows within the shipped "
               "model's trained length) takes about 6 minutes on a 2-core CPU; --tokens, --residency, --policies and "
               "--rules shorten it.")),
    "serve": (lambda parser: _application("serve").add_options(parser), dict(
        help="an OpenAI-compatible server for an mlx-lm MoE model directory, its experts streamed through an arena",
        description="Serves /v1/chat/completions, /v1/completions and /v1/models (mlx-lm's server) with the model "
                    "kq_mlx.load gives: one arena for every request, requests served one at a time. docs/serving.md")),
    "chat": (lambda parser: _application("chat").add_options(parser), dict(
        help="a conversation in the terminal with an mlx-lm MoE model directory, its experts streamed through an arena",
        description="Each line is a turn (the tokenizer's chat template where it has one), the reply streamed back; "
                    "one prompt cache holds the conversation. 'r' starts again, 'q' or the end of input ends it.")),
    "plan": (lambda parser: _application("plan").add_options(parser), dict(
        help="where a memory budget goes for a model, and the speed this machine's reads allow",
        description="Prints the split of --memory (non-expert weights, KV cache, tier, arena per layer) read from "
                    "the model's shapes, the read bandwidth of its experts measured now and the tokens per second "
                    "those reads allow. Nothing is loaded.")),
}


def _application(name: str):
    """kq's module of a subcommand, imported when it is named."""
    import importlib

    return importlib.import_module(f"kq.{name}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="kq", description="route_shed kernels, checked against one spec.")
    sub = parser.add_subparsers(dest="command", required=True)
    # `kq` itself takes no option but --help, so the first word that is no option names the subcommand; only
    # that one is given its options, whose imports (NumPy, the backends, the study) the others never pay.
    named = next((word for word in argv if not word.startswith("-")), None)
    for name, (add_options, keywords) in SUBCOMMANDS.items():
        subparser = sub.add_parser(name, **keywords)
        if name == named:
            add_options(subparser)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader went (`kq generate ... | head`): stop quietly, as a pipe's writer does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush goes nowhere
        return 1


if __name__ == "__main__":
    sys.exit(main())
