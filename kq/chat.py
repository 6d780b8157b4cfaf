"""``kq chat``: a conversation in the terminal with a model whose experts stream through an arena.

mlx-lm's chat loop on :func:`kq_mlx.load.load`'s model: each line you type is a turn, wrapped in the tokenizer's
chat template where it has one (else fed as it is), and the reply streams back; one prompt cache holds the
conversation, so each turn reads only its own tokens. ``r`` starts the conversation again, ``q`` or the end of
the input ends it.
"""

from __future__ import annotations

import sys


def add_options(parser) -> None:
    """``kq chat``'s options (``func`` runs it)."""
    from kq.model_options import add_model_options

    add_model_options(parser)
    parser.add_argument("--max-tokens", type=int, default=256, help="the most tokens a reply takes")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    parser.add_argument("--seed", type=int, default=None, help="MLX's random seed for the sampling")
    parser.add_argument("--system-prompt", default=None, help="the chat template's system message")
    parser.set_defaults(func=run)


def turn_ids(tokenizer, history: list[dict], text: str, system_prompt: str | None) -> list[int]:
    """The ids one turn adds to the conversation: the template's rendering of the new user message (after the
    system message on the first turn) with the assistant's turn begun, or the text itself without a template."""
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt and not history else [])
        messages.append({"role": "user", "content": text})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(text, add_special_tokens=not history))


def run(args) -> int:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from kq.model_options import load_model
    from kq_mlx.load import stream_of

    if args.max_tokens < 1 or not 0 <= args.temp or not 0 <= args.top_p <= 1:
        print("kq chat: --max-tokens must be >= 1, --temp >= 0 and --top-p in [0, 1]", file=sys.stderr)
        return 2
    loaded = load_model("chat", args)
    if loaded is None:
        return 2
    model, tokenizer = loaded
    stream = stream_of(model)
    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = make_sampler(args.temp, top_p=args.top_p)
    interactive = sys.stdin.isatty()
    print(f"kq chat: {args.model}, arena {stream.plan.slots} of {stream.plan.num_experts} experts a layer, rule "
          f"{stream.rule}; 'r' starts again, 'q' ends", file=sys.stderr, flush=True)
    cache, history = make_prompt_cache(model), []
    try:
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() == "q":
                break
            text = line.rstrip("\n")
            if text.strip() == "r":
                cache, history = make_prompt_cache(model), []
                continue
            if not text.strip():
                continue
            ids = turn_ids(tokenizer, history, text, args.system_prompt)
            reply = []
            for response in stream_generate(model, tokenizer, ids, max_tokens=args.max_tokens, sampler=sampler,
                                            prompt_cache=cache):
                print(response.text, end="", flush=True)
                reply.append(response.text)
            print(flush=True)
            history.append({"role": "user", "content": text})
            history.append({"role": "assistant", "content": "".join(reply)})
    except KeyboardInterrupt:
        print("\nkq chat: interrupted", file=sys.stderr)
        return 130
    finally:
        stream.close()
    return 0
