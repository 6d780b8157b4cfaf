"""Trains the Qwen3-MoE checkpoints that kq ships, on Python source, and writes them out.

Run from the repository root on a machine with JAX (a GPU: a few minutes on an H200):

    PYTHONPATH=. python models/train.py --out models/stdlib-moe
    python models/corpus.py --out out/corpus
    PYTHONPATH=. python models/train.py --out out/wheels-moe-bf16 --corpus out/corpus/corpus.zip \
        --layers 16 --vocab 8192 --steps 12000 --max-seconds 300 --lr 2e-3 --heldout-bytes 1000000 --eval-every 500
    python -m mlx_lm convert --hf-path out/wheels-moe-bf16 --mlx-path models/wheels-moe -q --q-bits 4 --q-group-size 64

The first is the small model (4 layers) on the standard library of the Python that runs it; the
second the deeper one (16 layers) on the corpus ``models/corpus.py`` builds from pinned wheels,
which mlx-lm then stores in 4 bits (``models/wheels-moe``: copy ``heldout.txt``, ``training.json``
and ``training.log`` beside it). Everything is fixed by ``--seed`` and the text
read: which files are held out (a hash of their path; with ``--corpus``, of their directory, so a
package's near-duplicate files stay on one side), the byte-level BPE tokenizer (trained on the
training files), the initialisation, the batches. The checkpoint directory gets ``config.json``,
``model.safetensors`` (bf16, one tensor per expert and projection, the Hugging Face layout),
``tokenizer.json`` and ``tokenizer_config.json`` (what ``mlx_lm.load`` reads), ``heldout.txt``
(the evaluation text) and ``training.json`` (the run: device, versions, time, losses, the step
kept (lowest validation loss) and the held-out measurements below).

Measured on the held-out text after training: the share of its characters that lie in 64-character
spans, starting at a line, also found in the training text; bits per byte of the model, of a unigram and of an
interpolated bigram model of the training tokens; per layer, the entropy of the expert load (bits;
log2 E is perfectly even), the share of routed entries taken by the most popular quarter of the
experts, and token-to-token reuse (the fraction of a token's top-k experts that the previous token
also routed to; k / E for independent routing).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import sysconfig
import time
import zipfile
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kq_jax import qwen3_moe

EOS = "<|endoftext|>"


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def stdlib_sources() -> list[tuple[str, str, str]]:
    """``(name, group, text)`` of each standard-library file; each file is its own group."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(name, name, path.read_text(encoding="utf-8", errors="replace"))
            for path in stdlib_files() for name in [path.relative_to(root).as_posix()]]


def corpus_sources(path: str) -> list[tuple[str, str, str]]:
    """``(name, group, text)`` of each file in ``models/corpus.py``'s zip; a file's group is its directory."""
    with zipfile.ZipFile(path) as corpus:
        return [(name, name.rsplit("/", 1)[0], corpus.read(name).decode("utf-8")) for name in sorted(corpus.namelist())]


def split_corpus(sources: list[tuple[str, str, str]], heldout_bytes: int) -> tuple[list[str], str, str]:
    """Training texts; a validation text (groups hashing to 1 mod 23), which picks the step kept; and the
    held-out text (groups hashing to 0 mod 23), which only the final measurements read. A group goes
    whole to one side: validation and held-out take theirs while they stay within ``heldout_bytes``,
    and every other group goes to training."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for name, group, text in sources:
        groups.setdefault(group, []).append((name, text))
    train, kept = [], {0: [], 1: []}
    for group, members in groups.items():
        bucket = kept.get(zlib.crc32(group.encode()) % 23)
        size = sum(len(text) for _, text in members)
        if bucket is not None and sum(map(len, bucket)) + size <= heldout_bytes:
            bucket.extend(f"# {name}\n{text}" for name, text in members)
        else:
            train.extend(text for _, text in members)
    return train, "\n".join(kept[1]), "\n".join(kept[0])


def shared_span_share(train: list[str], heldout: str, span: int = 64) -> float:
    """The share of ``heldout``'s characters inside a ``span``-character run that starts at one of its
    lines (leading blanks skipped) and also starts a line somewhere in ``train``."""

    def starts(text: str):
        position = 0
        for line in text.splitlines(keepends=True):
            begin = position + len(line) - len(line.lstrip())
            if begin + span <= len(text):
                yield begin
            position += len(line)

    seen = {hash(text[i:i + span]) for text in train for i in starts(text)}
    covered = np.zeros(len(heldout), bool)
    for i in starts(heldout):
        if hash(heldout[i:i + span]) in seen:
            covered[i:i + span] = True
    return float(covered.mean())


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def ngram_bits(train: np.ndarray, heldout: np.ndarray, vocab: int) -> tuple[float, float]:
    """Total bits of ``heldout`` under a unigram (add-one) and an interpolated bigram model of ``train``."""
    unigram = (np.bincount(train, minlength=vocab) + 1.0) / (train.size + vocab)
    pairs = np.bincount(train[:-1].astype(np.int64) * vocab + train[1:], minlength=vocab * vocab).reshape(vocab, vocab)
    row = pairs.sum(axis=1, keepdims=True)
    lam = row / (row + 50.0)  # Witten-Bell-like weight: trust rows seen often
    bigram = lam * pairs / np.maximum(row, 1) + (1 - lam) * unigram[None]
    uni_bits = -np.log2(unigram[heldout[1:]]).sum()
    bi_bits = -np.log2(bigram[heldout[:-1], heldout[1:]]).sum()
    return float(uni_bits), float(bi_bits)


def routing_stats(params, tokens, cfg, window: int, windows: int) -> dict:
    """Per layer: load entropy, top-quarter share and token-to-token reuse over held-out windows."""

    @jax.jit
    def routes(params, x):
        out, h = [], params["embed"][x]
        positions = jnp.arange(x.shape[1])[None]
        mask = jnp.tril(jnp.ones((x.shape[1],) * 2, bool))[None]
        for p in params["layers"]:
            q, k, v = qwen3_moe._qkv(p, qwen3_moe.rms_norm(h, p["input_layernorm"], cfg.rms_norm_eps), positions, cfg)
            h = h + qwen3_moe._attend(q, k, v, mask, cfg) @ p["o_proj"].T
            x2 = qwen3_moe.rms_norm(h, p["post_attention_layernorm"], cfg.rms_norm_eps)[0]
            indices, _, _ = qwen3_moe.route_layer(p, x2, cfg)
            out.append(indices)
            h = h + qwen3_moe.moe_resident(p, x2, cfg)[None]
        return out

    per_window = [routes(params, jnp.asarray(tokens[None, i * window:(i + 1) * window])) for i in range(windows)]
    layers = []
    for layer in range(cfg.num_hidden_layers):
        indices = np.concatenate([np.asarray(w[layer]) for w in per_window])
        load = np.bincount(indices.reshape(-1), minlength=cfg.num_experts) / indices.size
        nonzero = load[load > 0]
        top_quarter = np.sort(load)[::-1][: cfg.num_experts // 4].sum()
        reuse = np.mean([len(set(a) & set(b)) / cfg.num_experts_per_tok for w in range(windows)
                         for a, b in zip(indices[w * window + 1:(w + 1) * window], indices[w * window:(w + 1) * window - 1])])
        layers.append({"load_entropy_bits": float(-(nonzero * np.log2(nonzero)).sum()),
                       "top_quarter_share": float(top_quarter), "reuse": float(reuse)})
    return {"layers": layers, "even_entropy_bits": float(np.log2(cfg.num_experts)),
            "independent_reuse": cfg.num_experts_per_tok / cfg.num_experts, "tokens": int(window * windows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--corpus", help="models/corpus.py's corpus.zip (default: the standard library)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--max-seconds", type=float, default=420, help="stop training after this long")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--balance", type=float, default=0.001, help="load-balancing loss coefficient (Qwen3-MoE's)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--heldout-bytes", type=int, default=600_000)
    parser.add_argument("--eval-every", type=int, default=250, help="steps between validation measurements")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    sources = corpus_sources(args.corpus) if args.corpus else stdlib_sources()
    texts, validation, heldout = split_corpus(sources, args.heldout_bytes)
    tokenizer = train_tokenizer(texts, args.vocab)
    eos = tokenizer.token_to_id(EOS)
    train_tokens = np.concatenate([np.array(e.ids + [eos], np.int32) for e in tokenizer.encode_batch(texts)])
    heldout_tokens = np.array(tokenizer.encode(heldout).ids, np.int32)
    validation_tokens = np.array(tokenizer.encode(validation).ids, np.int32)
    print(f"{len(texts)} training files, {sum(map(len, texts)) / 1e6:.1f} MB, {train_tokens.size} tokens; "
          f"held out {len(heldout.encode()) / 1e3:.0f} kB, {heldout_tokens.size} tokens", flush=True)

    cfg = qwen3_moe.Qwen3MoeConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=128, num_hidden_layers=args.layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=64,
                                   num_experts_per_tok=8, moe_intermediate_size=64, norm_topk_prob=False,
                                   max_position_embeddings=args.seq * 8)
    params = qwen3_moe.init_params(cfg, jax.random.PRNGKey(args.seed))
    warmup = min(200, args.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1), args.lr * 0.05)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))
    state = optimizer.init(params)

    def loss_fn(params, batch):
        logits, balance = qwen3_moe.forward(params, batch[:, :-1], cfg)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return nll + args.balance * balance, (nll, balance)

    @jax.jit
    def step(params, state, batch):
        (_, (nll, balance)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, nll, balance

    @jax.jit
    def window_bits(params, window):
        logits, _ = qwen3_moe.forward(params, window[None, :-1], cfg)
        return optax.softmax_cross_entropy_with_integer_labels(logits[0], window[1:]).sum() / np.log(2)

    def text_bits(params, tokens, windows=None):
        """Bits of ``tokens`` in windows of the training length, every token but the first predicted once."""
        starts = range(0, (tokens.size - 1) // args.seq * args.seq, args.seq)
        starts = list(starts)[:windows] if windows else starts
        return sum(float(window_bits(params, jnp.asarray(tokens[i:i + args.seq + 1]))) for i in starts)

    rng = np.random.default_rng(args.seed)
    log, train_start, done = [], time.time(), 0
    best = (np.inf, 0, params)
    for done in range(1, args.steps + 1):
        starts = rng.integers(0, train_tokens.size - args.seq - 1, args.batch)
        batch = jnp.asarray(np.stack([train_tokens[s:s + args.seq + 1] for s in starts]))
        params, state, nll, balance = step(params, state, batch)
        if done % args.eval_every == 0 or done == args.steps:
            validation_bits = text_bits(params, validation_tokens, windows=64)
            if validation_bits < best[0]:
                best = (validation_bits, done, params)
            log.append({"step": done, "loss": float(nll), "balance": float(balance),
                        "validation_bits": round(validation_bits, 1), "seconds": round(time.time() - train_start, 1)})
            print(log[-1], flush=True)
        if time.time() - train_start > args.max_seconds:
            break
    train_seconds = time.time() - train_start
    _, kept_step, params = best

    n = (heldout_tokens.size - 1) // args.seq * args.seq
    model_bits = text_bits(params, heldout_tokens)
    predicted = heldout_tokens[: n + 1]
    uni_bits, bi_bits = ngram_bits(train_tokens, predicted, cfg.vocab_size)
    predicted_bytes = len(tokenizer.decode(predicted[1:].tolist()).encode())

    from safetensors.numpy import save_file

    save_file(qwen3_moe.to_hf_tensors(params), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg.hf_config(), "router_aux_loss_coef": args.balance}, indent=1)
                                     + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None, "unk_token": None,
        "model_max_length": cfg.max_position_embeddings, "clean_up_tokenization_spaces": False}, indent=1) + "\n")
    (out / "heldout.txt").write_text(heldout)
    record = {
        "date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0].device_kind),
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "optax": optax.__version__},
        "args": vars(args), "train_files": len(texts), "train_tokens": int(train_tokens.size),
        "heldout_tokens": int(heldout_tokens.size), "heldout_shared_span_share": shared_span_share(texts, heldout),
        "steps": done, "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - started, 1), "kept_step": kept_step,
        "kept_loss": next(e["loss"] for e in log if e["step"] == kept_step), "log": log,
        "heldout_bits_per_byte": {"model": model_bits / predicted_bytes, "unigram": uni_bits / predicted_bytes,
                                  "bigram": bi_bits / predicted_bytes, "bytes": predicted_bytes},
        "routing": routing_stats(params, heldout_tokens, cfg, args.seq, min(16, heldout_tokens.size // args.seq)),
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("steps", "kept_step", "train_seconds", "kept_loss",
                                             "heldout_bits_per_byte")}))
    print(json.dumps(record["routing"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
