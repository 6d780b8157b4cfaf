"""The options every command that loads a model through :func:`kq_mlx.load.load` takes, defined once:
``kq generate``, ``kq serve`` and ``kq plan``."""

from __future__ import annotations

import argparse

from kq_core.rules import LOADER_RULES as RULES  # noqa: E402 - the rules a loaded model runs


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def add_model_options(parser: argparse.ArgumentParser, *, rules: bool = True) -> None:
    """``--model``, the arena's size (``--memory`` or ``--residency``), ``--context`` and, with ``rules``, the
    miss rule and its tier's format."""
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="an mlx-lm MoE model directory (config.json, model*.safetensors, the tokenizer)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--memory", metavar="SIZE",
                      help="the memory budget, e.g. 8GiB or 16GB: the non-expert weights, the KV cache of "
                           "--context tokens, the tier and the arena; the arena gets what is left")
    size.add_argument("--residency", type=float, metavar="FRACTION",
                      help="instead of --memory: the fraction of each MoE layer's experts the arena holds "
                           "(default 0.25 where neither is given)")
    parser.add_argument("--context", type=_positive_int, default=4096,
                        help="tokens of KV cache the budget keeps room for")
    if rules:
        parser.add_argument("--rule", choices=RULES, default="exact",
                            help="a generated token's routed expert not in the arena: read before its layer runs "
                                 "(exact: the model's own tokens), served by a low-precision copy (tier), or "
                                 "dropped (shed)")
        from kq_host.tier import BITS, DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE, GROUP_SIZES

        parser.add_argument("--tier-bits", type=int, choices=BITS,
                            help=f"--rule tier: the copy's bits per weight (default {DEFAULT_TIER_BITS})")
        parser.add_argument("--tier-group-size", type=int, choices=GROUP_SIZES,
                            help=f"--rule tier: weights sharing a scale and bias (default {DEFAULT_TIER_GROUP_SIZE})")
    parser.add_argument("--float32", action="store_true",
                        help="run every float parameter in float32 (float models do on MLX's CPU backend anyway)")


def load_options(args: argparse.Namespace) -> dict:
    """:func:`kq_mlx.load.load`'s keyword arguments from the parsed options."""
    options = dict(memory=args.memory, residency=args.residency, context=args.context, float32=args.float32)
    if hasattr(args, "rule"):
        options.update(rule=args.rule, tier_bits=args.tier_bits, tier_group_size=args.tier_group_size)
    return options


def flag_of(error: Exception) -> str:
    """A :class:`kq_mlx.load.LoadError`'s message with its argument named as the command line's flag."""
    text = str(error)
    argument, colon, rest = text.partition(": ")
    if colon and argument.replace("_", "").replace("/", "").isalpha():
        flags = {"path": "--model"}
        named = "/".join(flags.get(part, "--" + part.replace("_", "-")) for part in argument.split("/"))
        return f"{named}: {rest}"
    return text


def load_model(command: str, args: argparse.Namespace):
    """``(model, tokenizer)`` from :func:`kq_mlx.load.load` with the parsed options, or None where the load is
    refused: the refusal printed on stderr as one line naming the flag (``kq serve: --memory: ...``)."""
    import sys

    from kq_mlx.load import LoadError, load

    try:
        return load(args.model, **load_options(args))
    except LoadError as error:
        print(f"kq {command}: {flag_of(error)}", file=sys.stderr)
        return None
