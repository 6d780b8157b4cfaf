"""The exact layer-by-layer decode loop for Qwen3-MoE: the host between layers, look-ahead prefetch.

Per token, per layer l, three small programs and the residency manager between them:

1. ``route`` (dispatched at once): layer l's attention and router. The host reads its top-k back
   and :meth:`kq_host.residency.ResidencyManager.acquire` makes every routed expert resident: the
   misses are read on the critical path, and the wait is measured.
2. ``experts``: layer l's experts from the arena through the returned table (every routed expert a
   hit, at its own score), and, with look-ahead, the routers of the next layers (l+1, and l+2 at depth
   2) applied to the output.
3. Layer l+1's ``route`` is dispatched right behind it; the host reads the predictions and
   :meth:`~kq_host.residency.ResidencyManager.prefetch` starts reading the predicted experts that
   are not resident, nearest layer first, so their reads overlap layer l+1's attention (and, for
   layer l+2's, all of layer l+1).

Every expert a layer runs is the one it routed, at its routed score, so what is resident never changes
the output: at any residency the logits are the loop's with every expert resident, bit for bit, and on
XLA's CPU backend those are the one-program resident model's (``decode_step``) too. On a GPU, XLA fuses
the per-layer programs otherwise than the whole-model one, and the two round differently in the last
bits (``tests/test_exact_loop.py``; docs/lookahead.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kq_core.validate import is_int, is_real
from kq_host.residency import PreloadError
from kq_jax import qwen3_moe
from kq_jax.moe import Experts, combine, experts_apply


@functools.partial(jax.jit, static_argnames="cfg")
def _route(p, h, position, keys, values, cfg):
    h, x, keys, values = qwen3_moe.attention_block(p, h, position, keys, values, cfg)
    indices, scores, _ = qwen3_moe.route_layer(p, x, cfg)
    return h, x, indices.astype(jnp.int32), scores, keys, values


@functools.partial(jax.jit, static_argnames="cfg")
def _experts(arena, layer, table, x, h, indices, scores, ahead, cfg):
    weights = Experts(*(arena[name][layer] for name in qwen3_moe.PROJECTIONS))
    y = combine(experts_apply(x, weights, table[indices]), scores)
    h = h + y[:, None]
    return h, tuple(qwen3_moe.predict_next(p, h[:, 0], cfg) for p in ahead)


DEFAULT_TIMEOUT_S = 60.0  # the longest a layer waits for its misses' reads before PreloadError


@jax.jit
def _embed(embed, token):
    return embed[jnp.reshape(token, (1,))][:, None]


@functools.partial(jax.jit, static_argnames="cfg")
def _logits(params, h, cfg):
    return qwen3_moe.rms_norm(h[:, 0], params["norm"], cfg.rms_norm_eps) @ params["embed"].T


class ExactLoop:
    """Greedy or teacher-forced decode of one sequence through an arena, exact, layer by layer.

    Args:
        params: :func:`kq_jax.qwen3_moe.load_params` (``experts=False`` is enough: the arena serves them).
        cfg: the model's :class:`~kq_jax.qwen3_moe.Qwen3MoeConfig`.
        manager: a :class:`~kq_host.residency.ResidencyManager` of L layers whose loader fills ``arena``.
        arena: the :class:`~kq_jax.arena.JaxArena` the manager writes (``{projection: [L, S, ...]}``).
        length: the longest sequence (the key-value cache's length).
        lookahead: how many layers ahead each layer predicts and prefetches: 0 (or ``False``) none,
            1 (or ``True``) the next layer, 2 the next two.
        prefetch_budget: most prefetch reads per predicted layer, layer and token (None: no limit).
        timeout: the longest, in seconds, a layer waits for its misses' reads (and the reads in flight
            before them) in :meth:`~kq_host.residency.ResidencyManager.acquire`; past it, :meth:`step`
            raises :class:`~kq_host.residency.PreloadError`. Default :data:`DEFAULT_TIMEOUT_S` (60 s:
            an expert read takes milliseconds, so only a stuck disk or loader waits that long); None
            waits forever.

    Raises:
        ValueError: the manager does not fit the model, or ``lookahead``, ``length`` or ``timeout`` is
            out of range.
    """

    def __init__(self, params, cfg, manager, arena, *, length: int, lookahead: bool = True,
                 prefetch_budget: int | None = None, timeout: float | None = DEFAULT_TIMEOUT_S):
        if manager.num_layers != cfg.num_hidden_layers or manager.num_experts != cfg.num_experts:
            raise ValueError(f"ExactLoop: manager has {manager.num_layers} layers of {manager.num_experts} experts; "
                             f"the model {cfg.num_hidden_layers} of {cfg.num_experts}")
        if manager.num_slots < cfg.num_experts_per_tok:
            raise ValueError(f"ExactLoop: manager has {manager.num_slots} slots a layer; a token routes "
                             f"{cfg.num_experts_per_tok}")
        if not isinstance(lookahead, (int, np.integer)) or not 0 <= lookahead <= 2:
            raise ValueError(f"ExactLoop: lookahead must be 0, 1, 2 or a bool, got {lookahead!r}")
        if not is_int(length) or length < 1:
            raise ValueError(f"ExactLoop: length must be an int >= 1, got {length!r}")
        if prefetch_budget is not None and (not is_int(prefetch_budget) or prefetch_budget < 0):
            raise ValueError(f"ExactLoop: prefetch_budget must be an int >= 0 or None, got {prefetch_budget!r}")
        if not isinstance(getattr(arena, "arrays", None), dict) or (manager.arena is not None and arena is not manager.arena):
            raise ValueError(f"ExactLoop: arena must be the JaxArena the manager writes (manager.arena), got "
                             f"{type(arena).__name__}")
        if tuple(getattr(arena, "shape", ())) != (manager.num_layers, manager.num_slots):
            raise ValueError(f"ExactLoop: arena holds {getattr(arena, 'shape', None)} layers and slots; the manager "
                             f"{manager.num_layers} of {manager.num_slots}")
        if timeout is not None and (not is_real(timeout) or not 0 < timeout < math.inf):
            raise ValueError(f"ExactLoop: timeout must be seconds > 0 (finite) or None to wait forever, "
                             f"got {timeout!r}")
        self.params, self.cfg, self.manager, self.arena = params, cfg, manager, arena
        self.lookahead, self.prefetch_budget, self.length = int(lookahead), prefetch_budget, length
        self.timeout = None if timeout is None else float(timeout)
        shape = (1, length, cfg.num_key_value_heads, cfg.head_dim)
        self._cache = [(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
                       for _ in range(cfg.num_hidden_layers)]
        # The (position, token) of a step that raised, and the layers whose routing it credited.
        self._credited: tuple[tuple[int, int], set[int]] = ((-1, -1), set())

    def step(self, token, position: int):
        """One token: ``token`` (int, or an integer ``[1]`` or scalar array such as the last argmax, read
        back to check it) at ``position`` -> logits float32 ``[1, V]`` (on the device).

        A step that raised :class:`~kq_host.residency.PreloadError` may be run again with the same token and
        position: the layers whose routing it credited read their misses again with
        ``acquire(..., credit=False)``, so each layer's routing is counted once (stats, LFU popularity).

        Raises:
            ValueError: ``token`` is not one integer in ``[0, vocab_size)`` or ``position`` not an int in
                ``[0, length)``; nothing runs.
            kq_host.residency.PreloadError: a layer's read failed or was still out after ``timeout``.
        """
        if not is_int(position) or \
                not 0 <= position < self.length:
            raise ValueError(f"ExactLoop.step: position must be an int in [0, {self.length}), got {position!r}")
        token = self._token_id(token)
        cfg, layers, manager = self.cfg, self.params["layers"], self.manager
        if self._credited[0] != (position, token):
            self._credited = ((position, token), set())
        credited = self._credited[1]
        h = _embed(self.params["embed"], np.int32(token))
        routed = _route(layers[0], h, position, *self._cache[0], cfg)
        for layer, p in enumerate(layers):
            h, x, indices, scores, keys, values = routed
            self._cache[layer] = keys, values
            ids, weights = jax.device_get((indices, scores))
            try:  # the critical path
                table = manager.acquire(layer, ids, weights, timeout=self.timeout, credit=layer not in credited)
            except PreloadError:
                credited.add(layer)  # acquire credits the routing before it reads
                raise
            credited.add(layer)
            targets = range(layer + 1, min(layer + 1 + self.lookahead, len(layers)))
            h, predicted = _experts(self.arena.arrays, np.int32(layer), table, x, h, indices, scores,
                                    tuple(layers[target] for target in targets), cfg)
            if layer + 1 < len(layers):
                routed = _route(layers[layer + 1], h, position, *self._cache[layer + 1], cfg)
            for target, (ids, weights) in zip(targets, jax.device_get(predicted)):
                manager.prefetch(target, ids, weights, budget=self.prefetch_budget)
        manager.next_token()
        self._credited = ((-1, -1), set())
        return _logits(self.params, h, cfg)

    def _token_id(self, token) -> int:
        """``token`` as an int in ``[0, vocab_size)``; ValueError naming ``token`` otherwise."""
        vocab = self.cfg.vocab_size
        value = np.asarray(token) if isinstance(token, (np.ndarray, jax.Array)) else token
        if isinstance(value, np.ndarray):
            if value.size != 1 or value.ndim > 1 or not np.issubdtype(value.dtype, np.integer):
                raise ValueError(f"ExactLoop.step: token must be one integer (an int, or an integer array of "
                                 f"shape () or [1]), got {value.dtype} {value.shape}")
            value = value.reshape(()).item()
        if not is_int(value) or \
                not 0 <= value < vocab:
            raise ValueError(f"ExactLoop.step: token must be an int in [0, {vocab}) (the vocabulary), got {token!r}")
        return int(value)
