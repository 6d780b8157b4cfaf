"""Qwen3-MoE in JAX, on the checkpoint files mlx-lm and Hugging Face load as ``qwen3_moe``.

Attention with per-head RMS norms on queries and keys, rotary embeddings (the
half-split form), grouped-query heads; an MoE feed-forward in every layer:
softmax router over E experts, top-k, SwiGLU experts, the top-k scores used as
they are unless ``norm_topk_prob``. Weights in the Hugging Face layout (one
tensor per expert and projection, ``[out, in]``). :func:`forward` runs whole
sequences (training, evaluation); :func:`decode_step` one token per sequence
with a key-value cache, its MoE feed-forward given by the caller, so an arena
layer can stand in for the resident one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kq_core.contract import EXPERT_PROJECTIONS
from kq_core.validate import is_int
from kq_host.checkpoint import CheckpointError, read_config
from kq_jax.arena_moe import router_topk
from kq_jax.moe import Experts, combine, experts_apply, router_probs

PROJECTIONS = EXPERT_PROJECTIONS


_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class Qwen3MoeConfig:
    """The ``config.json`` fields this implementation reads (Hugging Face names).

    Raises:
        ValueError: a size is not an int >= 1, a flag not a bool, ``rms_norm_eps`` or ``rope_theta`` not a
            finite number > 0, ``num_experts_per_tok`` exceeds ``num_experts``,
            ``num_attention_heads`` is not a multiple of ``num_key_value_heads`` or ``head_dim`` is odd
            (the rotary embedding splits it in halves).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048

    def __post_init__(self):
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts {self.num_experts}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (the rotary embedding splits it in halves), got {self.head_dim}")
        for name in ("norm_topk_prob", "tie_word_embeddings"):  # a string "false" would be taken as true
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_))
                    or not 0 < value < math.inf):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if (not is_int(self.max_position_embeddings)
                or self.max_position_embeddings < 1):
            raise ValueError(f"max_position_embeddings must be an int >= 1, got {self.max_position_embeddings!r}")

    @classmethod
    def load(cls, directory: str | Path) -> "Qwen3MoeConfig":
        """The checkpoint directory's ``config.json``.

        Raises:
            CheckpointError: the file is missing or not JSON, not ``qwen3_moe``, lacks a required key or
                holds a value no model has (the message names the file and the key).
        """
        path = Path(directory) / "config.json"
        raw = read_config(directory)
        if raw.get("model_type") != "qwen3_moe":
            raise CheckpointError(f"{path}: model_type {raw.get('model_type')!r}; this JAX model is "
                                  f"qwen3_moe (kq study --framework mlx also runs mixtral)")
        missing = [name for name in _POSITIVE_FIELDS if name not in raw]
        if missing:
            raise CheckpointError(f"{path}: lacks {', '.join(missing)}")
        try:
            return cls(**{name: raw[name] for name in cls.__dataclass_fields__ if name in raw})
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{path}: {error}") from None

    def hf_config(self) -> dict:
        """The whole ``config.json`` mlx-lm and transformers expect for this model."""
        return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **asdict(self),
                "intermediate_size": self.moe_intermediate_size, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "hidden_act": "silu", "torch_dtype": "bfloat16"}


def init_params(cfg: Qwen3MoeConfig, key) -> dict:
    """Random parameters (float32), scaled as usual for pre-norm transformers."""
    d, e, f, hd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.head_dim
    keys = iter(jax.random.split(key, 2 + 8 * cfg.num_hidden_layers))

    def normal(shape, fan_in):
        return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(fan_in)

    layers = []
    for _ in range(cfg.num_hidden_layers):
        layers.append({
            "input_layernorm": jnp.ones(d), "post_attention_layernorm": jnp.ones(d),
            "q_proj": normal((cfg.num_attention_heads * hd, d), d), "k_proj": normal((cfg.num_key_value_heads * hd, d), d),
            "v_proj": normal((cfg.num_key_value_heads * hd, d), d),
            "o_proj": normal((d, cfg.num_attention_heads * hd), cfg.num_attention_heads * hd * cfg.num_hidden_layers),
            "q_norm": jnp.ones(hd), "k_norm": jnp.ones(hd), "router": normal((e, d), d) * 0.1,
            "gate_proj": normal((e, f, d), d), "up_proj": normal((e, f, d), d),
            "down_proj": normal((e, d, f), f * cfg.num_hidden_layers),
        })
    return {"embed": normal((cfg.vocab_size, d), 1.0) * 0.02, "norm": jnp.ones(d), "layers": layers}


# ---- the checkpoint layout ---------------------------------------------------------------------


def _hf_names(layer: int) -> dict[str, str]:
    prefix = f"model.layers.{layer}."
    names = {"input_layernorm": "input_layernorm.weight", "post_attention_layernorm": "post_attention_layernorm.weight",
             "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight", "router": "mlp.gate.weight"}
    names.update({p: f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")})
    return {key: prefix + name for key, name in names.items()}


def to_hf_tensors(params: dict, dtype=jnp.bfloat16) -> dict[str, np.ndarray]:
    """``{tensor name: array}`` in the Hugging Face layout, one tensor per expert and projection."""
    import ml_dtypes

    def host(x):
        return np.asarray(jnp.asarray(x, dtype)).astype(ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else dtype)

    out = {"model.embed_tokens.weight": host(params["embed"]), "model.norm.weight": host(params["norm"])}
    for layer, p in enumerate(params["layers"]):
        out.update({name: host(p[key]) for key, name in _hf_names(layer).items()})
        for projection in PROJECTIONS:
            for expert in range(p[projection].shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"] = host(p[projection][expert])
    return out


def load_params(directory: str | Path, cfg: Qwen3MoeConfig, *, experts: bool = True) -> dict:
    """Parameters from the checkpoint's safetensors files, as float32 JAX arrays.

    A checkpoint mlx-lm stored quantized (``config.json`` has ``"quantization"``) is read
    dequantized (:func:`kq_host.checkpoint.dense_tensors`), its stacked experts as they are.
    With ``experts=False`` the expert weights are not read (an arena serves them); they are checked all
    the same. Every tensor of the model ``cfg`` describes must be there with its shape, and no other
    (the layers, the experts, the hidden size, the vocabulary, the heads), as mlx-lm's loader requires.

    Returns:
        ``{"embed": [V, D], "norm": [D], "layers": [{name: array}] * L}``, float32; each layer's experts
        ``gate_proj``/``up_proj`` ``[E, F, D]`` and ``down_proj`` ``[E, D, F]`` where ``experts``.

    Raises:
        CheckpointError: the directory holds no ``*.safetensors`` file, one cannot be read (truncated,
            corrupt), a tensor is in two files (naming both), tensors are missing or extra, or a tensor's shape
            is not the one ``cfg`` gives
            (the message names the file and the tensor), or ``cfg`` unties the output projection from
            the embedding (this model reads it from the embedding).
    """
    from kq_host.checkpoint import MODEL_FILES, Quantization, dense_tensors, model_files

    directory = Path(directory)
    if not cfg.tie_word_embeddings:
        raise CheckpointError(f"{directory / 'config.json'}: tie_word_embeddings false; this JAX model reads its "
                              f"output projection from the embedding")
    files = model_files(directory)
    if not files:
        raise CheckpointError(f"{directory}: holds no {MODEL_FILES} weights file")
    sources = _tensor_files(files)
    quantization = Quantization.of(directory)
    try:
        tensors = dense_tensors(directory, quantization)
    except Exception as error:  # a tensor past a file's end, a quantized module without its scales...
        raise CheckpointError(f"{directory}: its safetensors files cannot be read ({error})") from None
    _check_tensors(directory, cfg, {name: tuple(array.shape) for name, array in tensors.items()}, sources)

    def get(name):
        return jnp.asarray(tensors[name].astype(np.float32))

    def stacked(layer, projection):
        name = f"model.layers.{layer}.mlp.switch_mlp.{projection}.weight"
        if name in tensors:
            return get(name)
        return jnp.stack([get(f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight")
                          for e in range(cfg.num_experts)])

    layers = []
    for layer in range(cfg.num_hidden_layers):
        p = {key: get(name) for key, name in _hf_names(layer).items()}
        if experts:
            p.update({projection: stacked(layer, projection) for projection in PROJECTIONS})
        layers.append(p)
    return {"embed": get("model.embed_tokens.weight"), "norm": get("model.norm.weight"), "layers": layers}


def _tensor_files(files: list[Path]) -> dict[str, Path]:
    """``{tensor name: the file holding it}`` from the files' headers; CheckpointError naming a file that cannot
    be read, or a tensor in two files."""
    from kq_host.expert_store import ExpertStoreError, read_safetensors_headers

    try:
        return {name: entry.path for name, entry in read_safetensors_headers(files).items()}
    except ExpertStoreError as error:
        raise CheckpointError(f"{error}") from None


def _expected_shapes(cfg: Qwen3MoeConfig, stacked_layers: set[int]) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the model ``cfg`` describes and its shape; the layers in ``stacked_layers``
    hold their experts stacked (mlx-lm's ``switch_mlp``), the others one tensor per expert."""
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    heads, kv_heads = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer_shapes = {"input_layernorm": (d,), "post_attention_layernorm": (d,), "q_norm": (hd,), "k_norm": (hd,),
                    "router": (cfg.num_experts, d), "q_proj": (heads, d), "k_proj": (kv_heads, d),
                    "v_proj": (kv_heads, d), "o_proj": (d, heads)}
    expert_shapes = {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    for layer in range(cfg.num_hidden_layers):
        shapes.update({name: layer_shapes[key] for key, name in _hf_names(layer).items()})
        for projection, shape in expert_shapes.items():
            if layer in stacked_layers:
                shapes[f"model.layers.{layer}.mlp.switch_mlp.{projection}.weight"] = (cfg.num_experts, *shape)
            else:
                shapes.update({f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight": shape
                               for expert in range(cfg.num_experts)})
    return shapes


def _check_tensors(directory: Path, cfg: Qwen3MoeConfig, shapes: dict[str, tuple[int, ...]],
                   sources: dict[str, Path]) -> None:
    """CheckpointError unless ``shapes`` (``{tensor name: shape}``) are exactly the model ``cfg`` describes."""
    stacked = {int(name.split(".")[2]) for name in shapes if ".mlp.switch_mlp." in name}
    expected = _expected_shapes(cfg, stacked)
    described = (f"the model {directory / 'config.json'} describes ({cfg.num_hidden_layers} layers of "
                 f"{cfg.num_experts} experts, hidden_size {cfg.hidden_size}, vocab_size {cfg.vocab_size})")

    def listed(names):
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    extra = [name for name in shapes if name not in expected]
    if extra:
        files = sorted({str(sources.get(name, directory)) for name in extra})
        raise CheckpointError(f"{', '.join(files)}: {len(extra)} tensors not in {described}: {listed(extra)}")
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise CheckpointError(f"{directory}: lacks {len(missing)} tensors of {described}: {listed(missing)}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise CheckpointError(f"{sources.get(name, directory)}: {name} has shape {tuple(shapes[name])}; "
                                  f"{described} gives {shape}")


# ---- the model ---------------------------------------------------------------------------------


def rms_norm(x, weight, eps: float):
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x, positions, theta: float):
    """Rotary embedding, half-split form. x ``[..., T, H, hd]``, positions ``[..., T]``."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None, None].astype(jnp.float32) * freqs  # [..., T, 1, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _qkv(p, x, positions, cfg: Qwen3MoeConfig):
    *lead, _ = x.shape
    q = (x @ p["q_proj"].T).reshape(*lead, cfg.num_attention_heads, cfg.head_dim)
    k = (x @ p["k_proj"].T).reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
    v = (x @ p["v_proj"].T).reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
    q = rope(rms_norm(q, p["q_norm"], cfg.rms_norm_eps), positions, cfg.rope_theta)
    k = rope(rms_norm(k, p["k_norm"], cfg.rms_norm_eps), positions, cfg.rope_theta)
    return q, k, v


def _attend(q, k, v, mask, cfg: Qwen3MoeConfig):
    """q ``[B, Tq, H, hd]``, k/v ``[B, Tk, Hkv, hd]``, mask ``[B or 1, Tq, Tk]`` -> ``[B, Tq, H*hd]``."""
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * cfg.head_dim**-0.5
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return out.reshape(*out.shape[:2], -1)


def route_layer(p, x, cfg: Qwen3MoeConfig):
    """``(indices int32 [..., k], scores float32 [..., k], probs [..., E])``: checkpoint layer ``p``'s router top-k
    (:func:`kq_jax.moe.router_probs`, then :func:`kq_jax.arena_moe.router_topk`: with ``norm_topk_prob``
    renormalised by :func:`kq_jax.reference.normalize_topk_ref`, the contract's correctly rounded
    arithmetic, as every other router of kq)."""
    probs = router_probs(x, p["router"].T)
    indices, scores = router_topk(probs, top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob)
    return indices, scores, probs


def moe_resident(p, x, cfg: Qwen3MoeConfig):
    """The MoE feed-forward with every expert in memory. x ``[T, D]`` -> ``[T, D]``."""
    indices, scores, _ = route_layer(p, x, cfg)
    return combine(experts_apply(x, Experts(p["gate_proj"], p["up_proj"], p["down_proj"]), indices), scores)


def moe_dense(p, x, cfg: Qwen3MoeConfig):
    """Training form of :func:`moe_resident`: every expert computed, weighted by the top-k scores
    (zero elsewhere). Returns ``(y [N, D], load-balancing loss)`` (Switch Transformer's: E times
    the dot product of each expert's share of the routed entries and its mean probability)."""
    indices, scores, probs = route_layer(p, x, cfg)
    weights = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], indices].set(scores)
    gate = jnp.einsum("nd,efd->nef", x, p["gate_proj"])
    up = jnp.einsum("nd,efd->nef", x, p["up_proj"])
    y = jnp.einsum("nef,edf,ne->nd", jax.nn.silu(gate) * up, p["down_proj"], weights)
    share = jnp.mean(jax.nn.one_hot(indices, cfg.num_experts).sum(axis=1), axis=0) / cfg.num_experts_per_tok
    balance = cfg.num_experts * jnp.sum(share * jnp.mean(probs, axis=0))
    return y, balance


def forward(params, tokens, cfg: Qwen3MoeConfig, *, moe=moe_dense):
    """Logits for whole sequences. tokens int ``[B, T]`` -> ``(logits float32 [B, T, V], mean balance loss)``."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    h = params["embed"][tokens]
    balance = 0.0
    for p in params["layers"]:
        q, k, v = _qkv(p, rms_norm(h, p["input_layernorm"], cfg.rms_norm_eps), positions, cfg)
        h = h + _attend(q, k, v, mask, cfg) @ p["o_proj"].T
        x = rms_norm(h, p["post_attention_layernorm"], cfg.rms_norm_eps).reshape(b * t, -1)
        y, layer_balance = moe(p, x, cfg)
        h = h + y.reshape(b, t, -1)
        balance = balance + layer_balance
    logits = rms_norm(h, params["norm"], cfg.rms_norm_eps) @ params["embed"].T
    return logits, balance / cfg.num_hidden_layers


def empty_cache(cfg: Qwen3MoeConfig, batch: int, length: int):
    """Key-value cache ``[L, B, length, Hkv, hd]`` twice, zeros."""
    shape = (cfg.num_hidden_layers, batch, length, cfg.num_key_value_heads, cfg.head_dim)
    return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)


MoeFn = Callable[[int, dict, jax.Array], tuple[jax.Array, object]]


def decode_step(params, token, position, cache, cfg: Qwen3MoeConfig, moe: MoeFn, *, lookahead: int = 0):
    """One token per sequence. token int ``[B]``, position int scalar; ``moe(layer, p, x [B, D])``
    returns ``(y [B, D], report)``. Returns ``(logits [B, V], cache, reports)``.

    With ``lookahead`` = n > 0, after each layer l the routers of layers l+1 .. l+n are applied to its
    output (normalised as each of those layers normalises its MoE input, their attention skipped), and a
    fourth output holds those predictions: ``(ids int32 [L, n, B, k], scores float32 [L, n, B, k])``,
    ids -1 and scores 0 past the last layer.

    Raises:
        ValueError: ``lookahead`` is no int >= 0.
    """
    if not is_int(lookahead) or lookahead < 0:
        raise ValueError(f"decode_step: lookahead must be an int >= 0 (layers predicted ahead), got {lookahead!r}")
    keys, values = cache
    h = params["embed"][token][:, None]  # [B, 1, D]
    reports, predictions = [], []
    for layer, p in enumerate(params["layers"]):
        h, x, layer_keys, layer_values = attention_block(p, h, position, keys[layer], values[layer], cfg)
        keys, values = keys.at[layer].set(layer_keys), values.at[layer].set(layer_values)
        y, report = moe(layer, p, x)
        h = h + y[:, None]
        reports.append(report)
        if lookahead:
            predictions.append([_predict(params["layers"], layer + ahead, h[:, 0], cfg)
                                for ahead in range(1, lookahead + 1)])
    logits = rms_norm(h[:, 0], params["norm"], cfg.rms_norm_eps) @ params["embed"].T
    if lookahead:
        ids = jnp.stack([jnp.stack([ids for ids, _ in row]) for row in predictions])
        scores = jnp.stack([jnp.stack([scores for _, scores in row]) for row in predictions])
        return logits, (keys, values), reports, (ids, scores)
    return logits, (keys, values), reports


def attention_block(p, h, position, keys, values, cfg: Qwen3MoeConfig):
    """One layer up to its MoE: h ``[B, 1, D]``, the layer's cache ``keys``/``values`` ``[B, length, Hkv, hd]``
    -> ``(h after attention, x [B, D] the MoE's input, keys, values)``."""
    length = keys.shape[1]
    positions = jnp.full(h.shape[:2], position)
    mask = (jnp.arange(length) <= position)[None, None, :]
    q, k, v = _qkv(p, rms_norm(h, p["input_layernorm"], cfg.rms_norm_eps), positions, cfg)
    keys, values = keys.at[:, position].set(k[:, 0]), values.at[:, position].set(v[:, 0])
    h = h + _attend(q, keys, values, mask, cfg) @ p["o_proj"].T
    return h, rms_norm(h, p["post_attention_layernorm"], cfg.rms_norm_eps)[:, 0], keys, values


def predict_next(p_next, h, cfg: Qwen3MoeConfig):
    """A later layer's router on the residual stream ``h [B, D]``, normalised as that layer's MoE input:
    ``(ids int32 [B, k], scores float32 [B, k])``."""
    indices, scores, _ = route_layer(p_next, rms_norm(h, p_next["post_attention_layernorm"], cfg.rms_norm_eps), cfg)
    return indices.astype(jnp.int32), scores.astype(jnp.float32)


def _predict(layers, target: int, h, cfg: Qwen3MoeConfig):
    """Layer ``target``'s router on the residual stream ``h [B, D]`` (normalised as that layer's MoE input):
    ``(ids int32 [B, k], scores float32 [B, k])``; -1 and 0 where ``target`` is past the last layer."""
    k = cfg.num_experts_per_tok
    if target >= len(layers):
        return jnp.full((h.shape[0], k), -1, jnp.int32), jnp.zeros((h.shape[0], k), jnp.float32)
    return predict_next(layers[target], h, cfg)
